"""Versions: the package's own and the plugin contract's.

``CONTRACT_VERSION`` is "MAJOR.MINOR". A plugin states the contract version it
was written for; the core refuses a plugin whose MAJOR differs (the contract
changed incompatibly) and accepts any MINOR of the same MAJOR (minor versions
only add optional methods with defaults).
"""

from chitu_core.errors import PluginError

__version__ = "0.1.0"
CONTRACT_VERSION = "1.3"


def contract_major(version: str) -> int:
    """The MAJOR of a "MAJOR.MINOR" contract version string."""
    try:
        return int(str(version).split(".")[0])
    except ValueError as exc:
        raise PluginError(f"contract version {version!r} is not of the form MAJOR.MINOR") from exc


def check_contract(kind: str, name: str, origin: str, declared: object) -> None:
    """Raise PluginError unless ``declared`` is a contract version of our MAJOR.

    ``kind`` and ``name`` say what is checked ("backend", "cpu"); ``origin``
    names the distribution that shipped it, for the message.
    """
    if declared is None:
        raise PluginError(
            f"{kind} {name!r} from {origin} does not declare a contract version "
            f"(set `contract_version = \"{CONTRACT_VERSION}\"` on it); refusing to load it"
        )
    if contract_major(str(declared)) != contract_major(CONTRACT_VERSION):
        raise PluginError(
            f"{kind} {name!r} from {origin} targets chitu-core contract {declared}, but the "
            f"installed chitu-core {__version__} implements contract {CONTRACT_VERSION}; "
            f"install a release of {origin.split()[0]} built for contract "
            f"{contract_major(CONTRACT_VERSION)}.x, or a chitu-core that implements {declared}"
        )
