"""Structured output: grammars compiled by xgrammar, one matcher per constrained sequence, and the
packed token bitmask that a step applies on the device.

The contract with the engine (``Constraints``): ``add`` a constrained sequence when it is queued,
``bitmask`` its rows when a step that samples it is launched, ``accept`` each token it samples,
in order, and ``remove`` it when it finishes. A step's mask depends on every token before it, so a
constrained sequence's step is never launched before the host has accepted its previous token.

The bitmask is xgrammar's: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32``
set where token t is allowed; rows without a constraint are all ones. ``unpack_bitmask`` turns it
into a bool [rows, vocab] on whatever device it is on, in plain torch.

xgrammar is imported on first use, so an engine that never sees a constraint never loads it.
"""

import logging
import re
from collections import OrderedDict

import torch

from chitu_core.sampling.params import StructuredOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars an engine keeps (least recently used go first)


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message names what is unsupported."""


def _reason(exc: Exception) -> str:
    # xgrammar's C++ errors start with "[time] /path/file.cc:line: "; keep what follows.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()).strip()


def _fail(constraint: StructuredOutput, exc: Exception) -> GrammarError:
    kind = constraint.key[0]
    return GrammarError(f"the {kind} constraint is not supported: {_reason(exc)}")


def check(constraint: StructuredOutput) -> None:
    """Parse the constraint as the compiler will, without a tokenizer (cheap: no token tables).
    Raises GrammarError naming what is unsupported (an unknown type, a lookbehind, a missing rule)."""
    import xgrammar as xgr

    try:
        if constraint.json_schema is not None:
            xgr.Grammar.from_json_schema(constraint.key[1], any_whitespace=False, strict_mode=True)
        elif constraint.regex is not None:
            xgr.Grammar.from_regex(constraint.regex)
        elif constraint.grammar is not None:
            xgr.Grammar.from_ebnf(constraint.grammar)
    except (RuntimeError, ValueError) as exc:  # xgrammar's own errors are RuntimeErrors
        raise _fail(constraint, exc) from None


class GrammarCache:
    """Grammars compiled for one tokenizer, by constraint (``StructuredOutput.key``): a schema that
    comes again compiles once. JSON is compact (no free whitespace), so that a model cannot spend
    its tokens on blanks; a json_schema is strict (nothing the schema does not allow)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        if tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer, and this model has none")
        if hasattr(tokenizer, "hf_tokenizer"):  # a LightTokenizer: xgrammar reads transformers' (loaded now, once)
            tokenizer = tokenizer.hf_tokenizer()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # this class is the cache
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.num_compiled = 0  # compilations done (cache misses)

    def compile(self, constraint: StructuredOutput):
        """The xgrammar CompiledGrammar of the constraint; raises GrammarError."""
        key = constraint.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        c = self.compiler
        try:
            if constraint.json_object:
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif constraint.json_schema is not None:
                compiled = c.compile_json_schema(key[1], any_whitespace=False, strict_mode=True)
            elif constraint.regex is not None:
                compiled = c.compile_regex(constraint.regex)
            else:
                compiled = c.compile_grammar(constraint.grammar)
        except (RuntimeError, ValueError) as exc:
            raise _fail(constraint, exc) from None
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled


class Constraints:
    """The grammar matchers of an engine's constrained sequences, by sequence id."""

    def __init__(self, grammars: GrammarCache):
        self.grammars = grammars
        self._matchers: dict[int, object] = {}

    def add(self, seq_id: int, constraint: StructuredOutput) -> None:
        """Start a matcher for the sequence. Raises GrammarError (compile first to fail early)."""
        import xgrammar as xgr

        self._matchers[seq_id] = xgr.GrammarMatcher(self.grammars.compile(constraint))

    def remove(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, seq_ids: list[int]) -> torch.Tensor | None:
        """int32 [len(seq_ids), ceil(vocab / 32)] on the host, each constrained row's allowed
        next tokens and all ones elsewhere; None when no row is constrained."""
        rows = [(i, m) for i, sid in enumerate(seq_ids) if (m := self._matchers.get(sid)) is not None]
        if not rows:
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(seq_ids), self.grammars.vocab_size)  # all ones
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance the sequence's matcher by its sampled token. True when its output is complete
        (the grammar accepted a stop token), or when the token broke the grammar, which the mask
        prevents: then it is logged and the sequence ends all the same."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            log.error("sequence %d sampled token %d, which its grammar does not allow; ending it", seq_id, token)
            return True
        return matcher.is_terminated()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] packed bitmask -> bool [B, vocab_size], True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word is right too
    return bits.bool().flatten(1)[:, :vocab_size]
