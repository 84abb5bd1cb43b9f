"""The core names no device stack (CUDA, NCCL, HCCL, NPU) outside its portable kernels, comments and
docstrings: where it needs to know something about a device, it asks the backend."""

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE_WORDS = re.compile(r"cuda|nccl|hccl|(?<![a-z])npu", re.IGNORECASE)  # "input" is no NPU


def device_words(source: str) -> list[tuple[int, str]]:
    """(line, token) of every token naming a device stack, comments and docstrings excepted."""
    docstrings = {
        (node.body[0].lineno, node.body[0].col_offset)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)
    }
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type != tokenize.COMMENT and not (tok.type == tokenize.STRING and tok.start in docstrings)
        and DEVICE_WORDS.search(tok.string)
    ]


def test_device_word_scanner_skips_only_comments_and_docstrings():
    source = '"""CUDA graphs."""\ndef f(inputs):  # nccl\n    """On NPU."""\n    return "cuda", torch_npu, inputs\n'
    assert device_words(source) == [(4, '"cuda"'), (4, "torch_npu")]


def test_core_names_no_device():
    kernels = REPO / "chitu_core" / "kernels"  # portable device kernels, which the core never calls
    files = sorted(p for p in (REPO / "chitu_core").rglob("*.py") if kernels not in p.parents)
    assert REPO / "chitu_core" / "backend.py" in files and len(files) > 20
    found = [f"{p.relative_to(REPO)}:{line}: {tok}" for p in files for line, tok in device_words(p.read_text())]
    assert found == [], "device names in chitu_core (ask the backend instead):\n" + "\n".join(found)
