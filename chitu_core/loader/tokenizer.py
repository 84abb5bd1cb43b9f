"""A tokenizer and chat template read without transformers: ``LightTokenizer.load(path)``.

transformers costs a server ~90 MB of resident memory (and seconds of import) for what, for a
directory whose tokenizer is the generic fast class, is the ``tokenizers`` library's pipeline from
tokenizer.json plus a Jinja chat template. This module reproduces that much of
``AutoTokenizer.from_pretrained`` (transformers 5.x) and declines, returning None, wherever
transformers would do more; the caller then loads AutoTokenizer as before.

The light path is taken when all of these hold (``LightTokenizer.decline_reason`` says which failed):

- tokenizer.json and tokenizer_config.json are present, and config.json's ``model_type`` (if any) is
  a family whose hub tokenizer class transformers trusts (``TRUSTED_MODEL_TYPES``);
- tokenizer_config.json names the generic fast class (``TokenizersBackend`` or
  ``PreTrainedTokenizerFast``), has no ``auto_map`` (remote code) and no ``fast_tokenizer_files``.

What transformers then does, and so do we: the backend is tokenizer.json as the ``tokenizers``
library reads it, truncation and padding off; tokens of ``added_tokens_decoder`` and named special
tokens that the backend lacks are added to it (as ``TokenizersBackend.__init__`` adds them);
``add_bos_token``/``add_eos_token`` are ignored (tokenizer.json's post-processor rules);
``split_special_tokens`` and ``clean_up_tokenization_spaces`` (not for BPE models) are honoured. The
chat template is chat_template.jinja and additional_chat_templates/*.jinja, else tokenizer_config's
``chat_template`` (a string or a list of named templates), rendered as ``render_jinja_template``
renders it (``chitu_core.loader.chat_template``). transformers' tokenizer never reads
chat_template.json (a processor's file), so neither do we.

Structured output needs xgrammar's ``TokenizerInfo.from_huggingface``, which wants a transformers
tokenizer: ``hf_tokenizer()`` loads it from the same directory the first time it is asked for.
"""

import json
import logging
from pathlib import Path

from chitu_core.loader.chat_template import render_chat

log = logging.getLogger(__name__)

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
TRUSTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"})
"""Model types for which AutoTokenizer keeps a generic hub class (none is in transformers'
MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, nor a Mistral type that may switch to mistral-common)."""
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class LightTokenizer:
    """encode, decode and apply_chat_template as transformers' fast tokenizer has them, for the
    directory ``load`` accepted. ``decode`` and ``encode`` take ids and text only (no batches,
    tensors, padding or truncation)."""

    def __init__(self, path: Path, backend, specials: dict[str, str], extra_specials: list[str],
                 chat_template: str | dict | None, clean_up: bool):
        self.path = path
        self.backend = backend  # tokenizers.Tokenizer
        self.special_tokens_map = specials  # named special tokens -> their text, as transformers' property
        self.extra_special_tokens = extra_specials
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up
        self._hf = None

    @classmethod
    def load(cls, path: str | Path) -> "LightTokenizer | None":
        """The light tokenizer of ``path``, or None where transformers' tokenizer would differ (logged)."""
        path = Path(path)
        reason = cls.decline_reason(path)
        if reason is not None:
            log.debug("loading %s with transformers: %s", path, reason)
            return None
        from tokenizers import Tokenizer

        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        backend.no_truncation()  # transformers' encode turns both off unless asked (DO_NOT_TRUNCATE, DO_NOT_PAD)
        backend.no_padding()
        named, extras = _special_tokens(path, config)
        _add_missing_tokens(backend, path, config, named, extras)
        if backend.post_processor is None:
            from tokenizers import processors

            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        specials = {k: _text(v) for k, v in named.items() if v is not None}
        return cls(path, backend, specials, [_text(t) for t in extras], _chat_template(path, config), clean_up)

    @staticmethod
    def decline_reason(path: Path) -> str | None:
        """Why ``path``'s tokenizer needs transformers, or None when the light one is exact."""
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (path / name).is_file():
                return f"no {name}"
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            model = json.loads((path / "config.json").read_text(encoding="utf-8")) if (path / "config.json").is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"unreadable config ({exc})"
        if config.get("tokenizer_class") not in GENERIC_CLASSES:
            return f"tokenizer_class {config.get('tokenizer_class')!r} is not one of {sorted(GENERIC_CLASSES)}"
        if "auto_map" in config or "fast_tokenizer_files" in config:
            return "tokenizer_config.json names remote code or versioned tokenizer files"
        if "model_type" in model and model["model_type"] not in TRUSTED_MODEL_TYPES:
            return f"model_type {model['model_type']!r} is not one of {sorted(TRUSTED_MODEL_TYPES)}"
        return None

    # --- what the engine and server use -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, conversation, tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, chat_template: str | None = None, **kwargs):
        """The conversation rendered by the chat template (token ids with ``tokenize=True``, encoded
        without special tokens, as transformers does). Special tokens are template variables; the
        other keyword arguments are too, overriding them."""
        template = self.get_chat_template(chat_template, tools)
        text = render_chat(template, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template to render: transformers' choice among named templates ("tool_use" with tools, else "default")."""
        if isinstance(self.chat_template, dict):
            if chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(f"{self.path} has several chat templates and none is named 'default'; "
                             f"name one of {sorted(self.chat_template)}")
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(f"{self.path} has no chat template; pass one, or send a plain prompt")
        return self.chat_template

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        index = self.backend.token_to_id(token)
        if index is None and "unk_token" in self.special_tokens_map:
            return self.backend.token_to_id(self.special_tokens_map["unk_token"])
        return index

    def convert_ids_to_tokens(self, ids):
        return self.backend.id_to_token(ids) if isinstance(ids, int) else [self.backend.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    def hf_tokenizer(self):
        """transformers' tokenizer of the same directory, loaded once, for what needs one (xgrammar)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.path)
        return self._hf

    def __repr__(self) -> str:
        return f"LightTokenizer({str(self.path)!r}, vocab={len(self)})"


def _text(token) -> str:
    return token if isinstance(token, str) else token.content


def _added_token(value, special: bool | None = None):
    """An AddedToken from tokenizer_config's forms: a string, or a dict (with or without "__type")."""
    from tokenizers import AddedToken

    if isinstance(value, str):
        return value
    fields = {k: v for k, v in value.items() if k in TOKEN_FLAGS}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _special_tokens(path: Path, config: dict) -> tuple[dict, list]:
    """Named special tokens (str or AddedToken, or None) and extra ones, as transformers' _from_pretrained
    assembles them: tokenizer_config.json, and special_tokens_map.json where the config has no
    added_tokens_decoder."""
    named = {k: config.get(k) for k in NAMED_SPECIALS}
    named.update({k: v for k, v in config.items() if k.endswith("_token") and k not in named and isinstance(v, (str, dict))})
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extras, dict):
        named.update(extras)
        extras = []
    legacy = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        for key, value in json.loads(legacy.read_text(encoding="utf-8")).items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                extras = list(extras) + [v for v in value if v not in extras]
            elif isinstance(value, dict) and not key.endswith("special_tokens"):
                named[key] = _added_token(value, special=True)
            else:
                named[key] = value
    named = {k: (_added_token(v) if isinstance(v, dict) else v) for k, v in named.items()}
    return named, [(_added_token(v) if isinstance(v, dict) else v) for v in extras]


def _add_missing_tokens(backend, path: Path, config: dict, named: dict, extras: list) -> None:
    """Add to the backend what transformers' TokenizersBackend.__init__ adds: tokens of
    added_tokens_decoder (or, without one, of tokenizer.json) it lacks, then special tokens it lacks."""
    from tokenizers import AddedToken

    if "added_tokens_decoder" in config:
        decoder = {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    else:
        decoder = {t["id"]: AddedToken(**{k: v for k, v in t.items() if k in TOKEN_FLAGS})
                   for t in json.loads((path / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])}
    present = backend.get_added_tokens_decoder()
    have = {repr(t) for t in present.values()}
    to_add = [t for _, t in sorted(decoder.items()) if repr(t) not in have]
    encoder = [t.content for _, t in sorted(present.items())] + [_text(t) for t in to_add]
    for token in [*(v for v in named.values() if v is not None), *extras]:
        if _text(token) not in encoder and token not in to_add:
            to_add.append(token)
    names = {_text(v) for v in named.values() if v}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in names:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _chat_template(path: Path, config: dict) -> str | dict | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja) over tokenizer_config's chat_template."""
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    for file in sorted(extra.glob("*.jinja")) if extra.is_dir() else ():
        templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text
