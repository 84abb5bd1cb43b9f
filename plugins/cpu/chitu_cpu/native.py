"""Build a C++ function into a one-function Python extension, once per source, compiler and CPU.

``build(name, source, argtypes)`` compiles ``PRELUDE`` and ``source`` (which defines ``extern "C" void kernel(...)``) with
the machine's C++ compiler (``$CXX``, else ``g++``): -O3, -march=native, OpenMP (the process's OpenMP
runtime, the one PyTorch loaded, serves its parallel regions), plus a METH_FASTCALL binding whose
arguments are ``argtypes`` in order: pointers passed as ints (``tensor.data_ptr()``), ``int64_t`` and
``float``. The shared object is kept under ``<cache>/kernels`` (``chitu_core.loader.gguf.cache_root``),
named by a hash of the source, the compiler's version and the CPU's flags, and written under a temporary
name first, so that concurrent builds never load a partial file. Nothing of PyTorch's compiler stack is
imported (torch._inductor costs some 150 MB of resident memory and a second to import).
"""

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from chitu_core.loader.gguf import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PRELUDE = r"""
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
// 16 float lanes in GCC/Clang vector extensions: AVX-512 registers where the machine has them, else pairs or
// quads of narrower ones
typedef float V __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));
typedef int32_t VI __attribute__((vector_size(64)));
typedef uint32_t VU __attribute__((vector_size(64)));
typedef uint16_t VH __attribute__((vector_size(32)));

static inline V load(const float* p) { V r; std::memcpy(&r, p, sizeof r); return r; }
static inline V load(const uint16_t* p) {  // bfloat16: the upper half of a float32
#ifdef __AVX512F__  // one vpmovzxwd: GCC 12 widens 16-bit vectors lane by lane (scalar code)
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    return (V)_mm512_castsi512_ps(u);
#else
    VH h; std::memcpy(&h, p, sizeof h);
    VU u = __builtin_convertvector(h, VU) << 16;
    V r; std::memcpy(&r, &u, sizeof r); return r;
#endif
}
static inline float hsum(V x) {  // halves added, a tree (shuffles, not memcpy: an accumulator whose address is
    // taken is kept on the stack, and every FMA into it then goes through memory)
    const V8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const V4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline void put(float* p, float x) { *p = x; }
static inline void put(uint16_t* p, float x) {  // round to nearest even, as torch rounds float32 to bfloat16
    uint32_t u; std::memcpy(&u, &x, 4);
    if (x != x) { *p = 0x7FC0; return; }
    u += 0x7FFFu + ((u >> 16) & 1u);
    *p = uint16_t(u >> 16);
}
"""
"""What every kernel's source starts with (``build`` puts it first): the float vector ``V`` and its narrower
halves, loads of float32 and bfloat16 rows, a horizontal sum, and stores that round to bfloat16."""


def _binding(name: str, argtypes: list[str]) -> str:
    parse = []
    for i, t in enumerate(argtypes):
        t = t if t.endswith("*") else t.replace("const ", "")
        if t.endswith("*"):
            parse.append(f"reinterpret_cast<{t}>(PyLong_AsVoidPtr(args[{i}]))")
        elif t == "float":
            parse.append(f"static_cast<float>(PyFloat_AsDouble(args[{i}]))")
        else:
            parse.append(f"static_cast<{t}>(PyLong_AsLongLong(args[{i}]))")
    return f"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t n) {{
    if (n != {len(argtypes)}) {{
        PyErr_SetString(PyExc_TypeError, "{name}: {len(argtypes)} arguments");
        return nullptr;
    }}
    kernel({", ".join(parse)});
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
}}
static PyMethodDef methods[] = {{
    {{"kernel", (PyCFunction)(void (*)(void))call, METH_FASTCALL, ""}}, {{nullptr, nullptr, 0, nullptr}}}};
static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "{name}", nullptr, -1, methods}};
PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&module); }}
"""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(name: str, source: str, argtypes: list[str]):
    """The compiled ``kernel`` as a Python callable; raises RuntimeError (with the compiler's first
    errors) where there is no compiler or the source does not build."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX)")
    text = PRELUDE + source + _binding(name, argtypes)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([text, version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    root = cache_root() / "kernels"
    path = root / f"{name}_{key}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src = Path(tmp) / f"{name}.cpp"
            src.write_text(text)
            out = Path(tmp) / f"{name}.so"
            cmd = [cxx, *FLAGS, f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise RuntimeError(f"{cxx} failed: {' | '.join(errors[:3])}")
            os.replace(out, path)
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel
