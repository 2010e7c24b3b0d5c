"""Training configuration: one dataclass per component, loaded from TOML plus CLI overrides.

A :class:`Config` holds the sections ``model``, ``training``, ``parallel``, ``data``,
``checkpoint``, ``metrics``, ``fault`` and ``fault_tolerance``. Every field carries a one-line help text
(:func:`field_docs`, the source of docs/config.md's tables); every section validates itself
in ``__post_init__`` and raises :class:`ConfigError` whose message starts with the dotted key
(``training.lr: ...``) and says how to fix it. :func:`load_config` reads a TOML file and then
applies overrides written ``--section.key=value`` or ``--section.key value``.

``parallel.dp = -1`` means "the rest of the world size"; :meth:`Config.resolved` turns it (and
``parallel.n_microbatches = 0``) into concrete numbers once the world size is known and checks
that the batch divides evenly over the layout.

This package's face; its modules: ``_section`` (the section base, :class:`ConfigError`,
value coercion), ``_model`` (``[model]`` and :func:`num_transformer_params`), ``_parallel``
(``[parallel]``, the trainer's one layout type), ``_checkpoint`` (``[checkpoint]``),
``_fault_tolerance`` (``[fault_tolerance]``: torchft replica groups),
``_schema`` (the other sections and the :class:`Config` tree), ``_io`` (TOML, overrides,
dicts, the fingerprint, field docs).
"""

from trainer.config._checkpoint import CheckpointConfig
from trainer.config._fault_tolerance import FaultToleranceConfig
from trainer.config._io import (
    FINGERPRINT_FIELDS,
    config_fingerprint,
    config_from_argv,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    field_docs,
    load_config,
    parse_overrides,
)
from trainer.config._model import ModelConfig, num_transformer_params
from trainer.config._parallel import ParallelConfig
from trainer.config._schema import (
    ACTIVATION_CHECKPOINTING,
    Config,
    DataConfig,
    FaultConfig,
    MetricsConfig,
    TrainingConfig,
    recomputed_layers,
)
from trainer.config._section import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "TrainingConfig",
    "ParallelConfig",
    "DataConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "FaultConfig",
    "FaultToleranceConfig",
    "num_transformer_params",
    "recomputed_layers",
    "ACTIVATION_CHECKPOINTING",
    "FINGERPRINT_FIELDS",
    "load_config",
    "config_from_argv",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "config_fingerprint",
    "parse_overrides",
    "field_docs",
]
