"""Which transformers class ``load_model`` builds for a checkpoint: the one its config.json's
``architectures`` names (``BertModel``, ``LlamaForCausalLM``, ``Qwen3ForSequenceClassification``
...), from transformers itself (no code shipped with a checkpoint is run), built from the
checkpoint's config class; ``AutoModelForCausalLM`` where config.json names none. Anything else
is a :class:`CheckpointError` that names the class and why it cannot be built.
"""

from __future__ import annotations

from typing import Any

from quantdispatch.errors import CheckpointError, ConfigurationError, format_error

__all__ = ["build_model"]


def build_model(config: Any, model_class: Any = None, **from_config_kwargs: Any) -> Any:
    """The model ``config`` describes, built with ``from_config_kwargs`` (``dtype``,
    ``attn_implementation``...). ``model_class``: a transformers class to build instead of the
    one config.json names (a model class or an ``AutoModelFor...`` class)."""
    cls = _checked(model_class, config) if model_class is not None else _named_class(config)
    if _is_auto(cls):
        return cls.from_config(config, **from_config_kwargs)
    return cls._from_config(config, **from_config_kwargs)


def _is_auto(cls: Any) -> bool:
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return isinstance(cls, type) and issubclass(cls, _BaseAutoModelClass)


def _named_class(config: Any) -> Any:
    import transformers

    names = getattr(config, "architectures", None) or []
    if not names:
        return transformers.AutoModelForCausalLM
    name = names[0]
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        auto_map = getattr(config, "auto_map", None) or {}
        remote = any(str(name) in str(v) for v in auto_map.values())
        why = (
            "its code ships with the checkpoint (auto_map), and load_model runs no code from a "
            "checkpoint"
            if remote
            else f"transformers {transformers.__version__} defines no class of that name"
        )
        raise CheckpointError(
            format_error(
                f"config.json names the architecture {name!r}: {why}",
                "load_model builds the transformers class that config.json's architectures "
                "names",
                "upgrade transformers if the class is newer than it, or pass model_class= (a "
                "transformers class, e.g. transformers.AutoModel)",
            )
        )
    return _checked(cls, config, f"config.json's architecture {name!r}")


def _checked(cls: Any, config: Any, what: str | None = None) -> Any:
    """``cls`` if it builds a model from ``config``; else the error saying why not."""
    from transformers import PreTrainedModel

    from_file = what is not None
    what = what or f"model_class={getattr(cls, '__name__', cls)!r}"
    error = CheckpointError if from_file else ConfigurationError
    if _is_auto(cls):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise error(
            format_error(
                f"{what} is not a transformers model class",
                "load_model builds a PreTrainedModel subclass or an AutoModel class",
                "fix config.json's architectures, or pass model_class= (the class itself, e.g. "
                "transformers.AutoModel)"
                if from_file
                else "pass the class itself, e.g. model_class=transformers.AutoModel",
            )
        )
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        raise error(
            format_error(
                f"{what} is built from a {wanted.__name__}, but config.json's model_type "
                f"{getattr(config, 'model_type', None)!r} gives a {type(config).__name__}",
                "a model class is built from its own config class",
                "fix config.json's architectures (or model_type), or pass a model_class= that "
                f"takes a {type(config).__name__}",
            )
        )
    return cls
