"""Settings of ``lrmoe train``: :class:`TrainConfig`, the sections gathered and checked
across sections (the sections are in :mod:`lrmoe.training.sections`, key names and type
coercion in :mod:`lrmoe.training.keys`; this module re-exports both). Presets, YAML / ``--set`` composition and the resume check are in
:mod:`lrmoe.training.compose`.

Sections (the YAML nesting and the dotted ``--set`` names): ``model`` (:class:`ModelConfig`),
``data`` (:class:`DataConfig`), ``optim`` (:class:`OptimConfig`), ``lrmoe``
(:class:`lrmoe.moe.config.BackwardConfig`, the layers' own planned-backward schema), ``parallel`` (:class:`ParallelConfig`), ``run``
(:class:`RunConfig`), gathered in :class:`TrainConfig`. Every field also has a flat name,
its bare field name (``lr`` is ``optim.lr``, ``data`` is ``data.source``), the spelling of
earlier versions: ``--set`` and YAML files accept it (``build_config`` notes each flat key
of a YAML file), and :meth:`TrainConfig.from_dict` reads the flat form of a checkpoint's
``train_config.json``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

# re-exported: the names users and lrmoe.training.train import from here
from lrmoe.training.keys import (FLAT_KEYS, config_keys, flatten, mapping_keys,  # noqa: F401
                                 resolve_key, section_from_mapping, set_key)
from lrmoe.training.sections import (SECTION_TYPES, SECTIONS, DataConfig,  # noqa: F401
                                     BackwardConfig, ModelConfig, OptimConfig, ParallelConfig,
                                     RunConfig)


@dataclass
class TrainConfig:
    """Everything that defines a run of ``lrmoe train``: one field per section.

    ``TrainConfig(model=..., run=...)`` takes section objects or mappings; missing sections
    get their defaults. Validated on construction.

    Raises:
        ValueError: naming ``section.field``, on any invalid value (see :meth:`validate`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lrmoe: BackwardConfig = field(default_factory=BackwardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, section_from_mapping(cls, value, name))
            elif not isinstance(value, cls):
                raise ValueError(f"{name} must be a {cls.__name__} or a mapping of its "
                                 f"fields, got {value!r}")
        self.validate()

    def validate(self) -> None:
        """Check every section, then the settings that span sections.

        Raises:
            ValueError: naming the field(s), the value and what is accepted.
        """
        for name in SECTIONS:
            getattr(self, name).validate()
        m, d, ep = self.model, self.data, self.parallel.ep_size
        if m.init_from is None:
            if d.seq_len > m.max_position_embeddings:
                raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_position_"
                                 f"embeddings={m.max_position_embeddings}; raise the latter")
            check_ep_divides(m.num_experts, ep, "model.num_experts")
            if self.parallel.policy is not None:
                # the planner's own bound, here before the model is built rather than at
                # the first layer's plan
                from lrmoe.planner.plan import check_slots
                try:
                    check_slots(self.parallel.replica_slots, 0, m.num_experts)
                except ValueError as err:
                    raise ValueError(f"parallel.{err} (model.num_experts)") from None
        if ep > 1 and self.lrmoe.retained_mass_target > 0:
            raise ValueError(f"lrmoe.retained_mass_target (the adaptive rate) runs on one "
                             f"device only, but parallel.ep_size={ep}; use a fixed "
                             "lrmoe.recalibration_rate with --ep")
        if self.parallel.dp_size > 1 and self.lrmoe.retained_mass_target > 0:
            raise ValueError(f"lrmoe.retained_mass_target (the adaptive rate) runs on one "
                             f"device only, but parallel.dp_size={self.parallel.dp_size}; "
                             "use a fixed lrmoe.recalibration_rate with --dp")

    @property
    def backward(self) -> BackwardConfig:
        """The ``lrmoe`` section as the layers get it (``patch_moe_blocks``): its seed, when
        None, is ``run.seed``."""
        s = self.lrmoe
        return dataclasses.replace(s, seed=self.run.seed if s.seed is None else s.seed)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON/YAML-able nested dict (one mapping per section, ``betas`` a list)."""
        d = {name: _fields(getattr(self, name)) for name in SECTIONS}
        d["optim"]["betas"] = list(self.optim.betas)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        """Build from a nested mapping (as :meth:`to_dict` writes; missing fields get
        their defaults) or from the flat form of earlier versions (top-level fields plus a
        ``model`` mapping), coercing types.

        Raises:
            ValueError: an unknown key (with close matches), one setting given twice
                (nested and flat, naming both), or a value of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"config must be a mapping, got {data!r}")
        nested: Dict[str, Any] = {}
        for dotted, _, value in mapping_keys(data, "config"):
            set_key(nested, dotted, value)
        return cls(**{name: section_from_mapping(SECTION_TYPES[name], nested.get(name, {}),
                                                  name) for name in SECTIONS})

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy. Keys: section names (a section object or a mapping replaces
        the whole section) or flat field names (``lr=1e-3``, ``steps=5``, ``data="gcide"``).

        Raises:
            ValueError: an unknown key or an invalid value.
        """
        d = self.to_dict()
        for key, value in changes.items():
            if key in SECTIONS and dataclasses.is_dataclass(value):
                d[key] = _fields(value)
            elif key in SECTIONS and isinstance(value, Mapping):
                d[key] = dict(value)
            else:
                set_key(d, resolve_key(key), value)
        return TrainConfig.from_dict(d)


def _fields(section: Any) -> Dict[str, Any]:
    """A section's settable fields (not the derived ones, e.g. ``BackwardConfig.rate_pq``)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.init}


def check_ep_divides(num_experts: int, ep_size: int, what: str) -> None:
    """Every EP rank holds E / ep_size experts.

    Raises:
        ValueError: ``ep_size`` does not divide ``num_experts`` (``what`` names where E
            came from).
    """
    if num_experts % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} must divide {what}={num_experts} (each "
                         f"rank holds E / ep_size experts); choose --ep among "
                         f"{[n for n in range(1, num_experts + 1) if num_experts % n == 0]}")
