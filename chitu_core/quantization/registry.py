"""The registry of quantization methods by name."""

from chitu_core.errors import ChituError
from chitu_core.quantization.base import QuantMethod, UnquantizedMethod

_METHODS: dict[str, type[QuantMethod]] = {"unquantized": UnquantizedMethod}
_ORIGINS: dict[str, str] = {"unquantized": "chitu-core"}


def register_quant_method(cls: type[QuantMethod], origin: str = "") -> type[QuantMethod]:
    """Add a method (usable as a class decorator). A second method under a taken name is an error."""
    if cls.name in _METHODS and _METHODS[cls.name] is not cls:
        raise ChituError(
            f"quantization method {cls.name!r} from {origin or cls.__module__} is already registered "
            f"by {_ORIGINS[cls.name]}; pick another name"
        )
    _METHODS[cls.name] = cls
    _ORIGINS[cls.name] = origin or ("chitu-core" if cls.__module__.startswith("chitu_core.") else cls.__module__)
    return cls


def get_quant_method(name: str) -> type[QuantMethod]:
    """The method registered as ``name``; an error lists the known ones."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ChituError(f"unknown quantization method {name!r}; known: {', '.join(sorted(_METHODS))}") from None


def all_quant_methods() -> dict[str, type[QuantMethod]]:
    """Every registered method class by name."""
    return dict(_METHODS)


def quant_method_names() -> dict[str, str]:
    """Every registered method name -> where it came from."""
    return dict(_ORIGINS)
