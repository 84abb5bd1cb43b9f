"""Versions: the package's own and the plugin contract's.

``CONTRACT_VERSION`` is "MAJOR.MINOR". A plugin states the contract version it
was written for. The core refuses a plugin whose MAJOR differs (the contract
changed incompatibly). It accepts any MINOR of its MAJOR: an older one because
minor versions only add optional methods with defaults, a newer one with a
``ContractWarning``, since the plugin may rely on additions this core lacks.
"""

import warnings

from chitu_core.errors import PluginError

__version__ = "0.1.0"
CONTRACT_VERSION = "1.18"


class ContractWarning(UserWarning):
    """A plugin was written for a newer minor contract than this core implements."""


def parse_contract(version: object) -> tuple[int, int]:
    """(MAJOR, MINOR) of a "MAJOR.MINOR" contract version ("2" reads as 2.0)."""
    major, _, minor = str(version).strip().partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError as exc:
        raise PluginError(f"contract version {version!r} is not of the form MAJOR.MINOR") from exc


def contract_major(version: str) -> int:
    """The MAJOR of a "MAJOR.MINOR" contract version string."""
    return parse_contract(version)[0]


def check_contract(kind: str, name: str, origin: str, declared: object) -> None:
    """Raise PluginError unless ``declared`` is a contract version of our MAJOR; warn
    (``ContractWarning``) when it is a newer MINOR than ours.

    ``kind`` and ``name`` say what is checked ("backend", "cpu"); ``origin``
    names the distribution that shipped it, for the message.
    """
    if declared is None:
        raise PluginError(
            f"{kind} {name!r} from {origin} does not declare a contract version "
            f"(set `contract_version = \"{CONTRACT_VERSION}\"` on it); refusing to load it"
        )
    (major, minor), (ours, our_minor) = parse_contract(declared), parse_contract(CONTRACT_VERSION)
    if major != ours:
        raise PluginError(
            f"{kind} {name!r} from {origin} targets chitu-core contract {declared}, but the "
            f"installed chitu-core {__version__} implements contract {CONTRACT_VERSION}; "
            f"install a release of {origin.split()[0]} built for contract "
            f"{ours}.x, or a chitu-core that implements {declared}"
        )
    if minor > our_minor:
        warnings.warn(
            f"{kind} {name!r} from {origin} targets chitu-core contract {declared}, newer than the contract "
            f"{CONTRACT_VERSION} of the installed chitu-core {__version__}; it is loaded, but what it relies on "
            f"from contracts {ours}.{our_minor + 1} to {declared} is missing here: upgrade chitu-core",
            ContractWarning,
            stacklevel=2,
        )
