"""PEP 517 backend: setuptools' own hooks, with build/ and *.egg-info in a temporary directory, not this tree."""
import atexit, os, shutil, tempfile  # noqa: E401

from setuptools.build_meta import *  # noqa: F401,F403  (every hook: build_meta's __all__)

_tmp = tempfile.mkdtemp(prefix="chitu-build-")  # setuptools reads DIST_EXTRA_CONFIG after setup.cfg
atexit.register(shutil.rmtree, _tmp, True)
with open(os.path.join(_tmp, "setup.cfg"), "w") as config:
    config.write(f"[build]\nbuild_base = {_tmp}/build\n[egg_info]\negg_base = {_tmp}\n")
os.environ["DIST_EXTRA_CONFIG"] = config.name
