"""The sharded training state of an expert-parallel model and its optimizer, for
``torch.distributed.checkpoint`` (DCP): one key per tensor, experts as DTensors.

Keys: ``model.<name>`` for every entry of ``model.state_dict()`` and
``optim.<name>.<stat>`` for every tensor of the optimizer's per-parameter state (AdamW:
``step``, ``exp_avg``, ``exp_avg_sq``), ``<name>`` the parameter's state-dict name, so
the saved form depends neither on the optimizer's parameter numbering nor on the EP size.

Expert-sharded parameters (:data:`lrmoe.parallel.data_parallel.EXPERT_PARAM_ATTR`:
rank d of an EP group of N holds experts ``[d*E/N, (d+1)*E/N)`` of each stacked expert
tensor, :func:`lrmoe.parallel.data_parallel.shard_experts`) and their optimizer tensors of
the same shape enter as ``DTensor`` s of global shape (E, ...) placed ``Shard(0)`` on the
ep dim of the run's mesh (``Replicate()`` on dp). Everything else enters as the plain
tensor every rank holds. DCP then writes every chunk once (its save planner drops
duplicates: a dense tensor or a dp replica is written by one rank), records global
shapes, and on load gives each rank the rows its tensors cover, whatever EP / DP size
wrote them: that is the re-sharding (E must stay divisible by the EP size).

Outside a process group (one process) every tensor is plain and whole, so a
single-process checkpoint and an EP one have the same keys and shapes.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lrmoe.parallel.data_parallel import is_expert_param

MODEL_PREFIX, OPTIM_PREFIX = "model.", "optim."


def checkpoint_mesh(groups: Any) -> Any:
    """The ``DeviceMesh`` the expert DTensors live on: the run's (dp, ep) mesh, or a 1-D
    ``("ep",)`` mesh over the EP group when there is no dp dim; None outside a group.

    Args:
        groups: :class:`lrmoe.parallel.group.DpEpGroups` or None.
    """
    if groups is None:
        return None
    if groups.mesh is not None:
        return groups.mesh
    from torch.distributed.device_mesh import DeviceMesh

    device_type = "cuda" if dist.get_backend(groups.ep) == "nccl" else "cpu"
    return DeviceMesh.from_group(groups.ep, device_type, mesh_dim_names=("ep",))


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns on every single-process save / load that it assumes one process; that is
    meant here (a one-process run, export, ``model.init_from``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded_state(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       mesh: Any, process_group: Any = None) -> None:
    """``dcp.save`` of :func:`sharded_state` into the folder ``path`` (a collective over
    ``process_group`` when ``mesh`` is not None; each chunk written by one rank)."""
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet():
        dcp.save(sharded_state(model, optimizer, mesh), checkpoint_id=path,
                 process_group=process_group, no_dist=mesh is None)


def _placements(mesh: Any) -> List[Any]:
    from torch.distributed.tensor import Replicate, Shard

    # the last mesh dim is ep; a leading dp dim holds replicas
    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]


def _expert_names(model: nn.Module) -> Dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if is_expert_param(p)}


def _as_global(t: Tensor, mesh: Any) -> Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, mesh, _placements(mesh), run_check=False)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[int, str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    names: Dict[int, str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError("the optimizer holds a parameter that is not in the model; "
                                 "build the optimizer over model.parameters()")
            names[id(p)] = by_id[id(p)]
    return names


def sharded_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                  mesh: Any) -> Dict[str, Tensor]:
    """The state to pass to ``dcp.save``: see the module docstring for the keys.

    Args:
        model: the (patched, expert-sharded) model.
        optimizer: its optimizer, or None (model only).
        mesh: :func:`checkpoint_mesh` (None: one process, every tensor plain).

    Returns:
        ``{key: tensor or DTensor}``; the tensors are the live ones (not copies).
    """
    experts = _expert_names(model) if mesh is not None else {}
    out: Dict[str, Tensor] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        out[MODEL_PREFIX + name] = _as_global(t, mesh) if name in experts else t
    if optimizer is not None:
        names = _param_names(model, optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                for stat, v in optimizer.state.get(p, {}).items():
                    if not isinstance(v, Tensor):
                        continue
                    sharded = name in experts and v.shape == p.shape
                    out[f"{OPTIM_PREFIX}{name}.{stat}"] = _as_global(v, mesh) if sharded else v
    return out


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """The optimizer's hyper-parameter groups with parameter NAMES in place of its indices
    (what ``trainer_state.pt`` keeps beside the DCP tensors)."""
    names = _param_names(model, optimizer)
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append(g)
    return groups


def read_metadata(path: str) -> Dict[str, Any]:
    """The tensors' metadata of the DCP folder ``path``, after checking that every chunk
    file it names is there.

    Raises:
        FileNotFoundError: no ``.metadata`` (not a DCP folder), or a chunk file missing
            (naming it).
    """
    import os

    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path}: no .metadata; not a torch.distributed.checkpoint "
                                "folder (the checkpoint's state/)")
    meta = FileSystemReader(path).read_metadata()
    files = {info.relative_path for info in (meta.storage_data or {}).values()}
    for name in sorted(files):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{os.path.join(path, name)} is missing: the checkpoint is incomplete (copied "
                "in part, or a file was deleted); restore it or use another checkpoint")
    return meta.state_dict_metadata


def _check_model_keys(path: str, meta: Mapping[str, Any], target: Mapping[str, Tensor]) -> None:
    missing = [k for k in target if k not in meta]
    bad = [k for k in target if k in meta and tuple(meta[k].size) != tuple(target[k].shape)]
    if missing or bad:
        raise ValueError(f"checkpoint {path} does not hold this model: missing "
                         f"{[k[len(MODEL_PREFIX):] for k in missing[:3]]}, other shapes "
                         f"{[k[len(MODEL_PREFIX):] for k in bad[:3]]}; load it into the "
                         "model it was saved with")


def load_whole(path: str, tensors: Mapping[str, Tensor]) -> None:
    """Fill the whole tensors ``{state-dict name: tensor}`` in place from the DCP folder
    ``path``, in this process alone (no collective; whatever EP size wrote it).

    Raises:
        ValueError: a name missing from the checkpoint or of another global shape.
    """
    import torch.distributed.checkpoint as dcp

    target = {MODEL_PREFIX + k: v for k, v in tensors.items()}
    _check_model_keys(path, read_metadata(path), target)
    with _one_process_quiet():
        dcp.load(target, checkpoint_id=path, no_dist=True)


def load_sharded_state(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       groups_saved: Optional[List[Mapping[str, Any]]], mesh: Any,
                       process_group: Any = None) -> None:
    """Load what :func:`sharded_state` saved at ``path`` into ``model`` (and
    ``optimizer``), each rank reading the rows of its own expert shard. A collective
    over ``process_group`` when ``mesh`` is not None.

    Args:
        path: the DCP folder. model, optimizer: as built for this run (optimizer None:
            weights only). groups_saved: :func:`optimizer_groups` of the saved run
            (needed with an optimizer). mesh: :func:`checkpoint_mesh` of THIS run.
        process_group: the group DCP coordinates over (WORLD), None outside a group.

    Raises:
        ValueError: the checkpoint lacks a tensor of this model or has other global
            shapes (another model), naming the first keys; or its optimizer groups do not
            name this model's parameters.
    """
    import torch.distributed.checkpoint as dcp

    meta = read_metadata(path)
    experts = _expert_names(model) if mesh is not None else {}
    target: Dict[str, Tensor] = {}
    live = model.state_dict()
    for name, t in live.items():
        target[MODEL_PREFIX + name] = _as_global(t, mesh) if name in experts else t
    _check_model_keys(path, meta, target)
    stats: Dict[Tuple[str, str], Tensor] = {}
    if optimizer is not None:
        params = dict(model.named_parameters())
        for key, m in meta.items():
            if not key.startswith(OPTIM_PREFIX) or not hasattr(m, "size"):
                continue
            name, stat = key[len(OPTIM_PREFIX):].rsplit(".", 1)
            if name not in params:
                raise ValueError(f"checkpoint {path}: optimizer state for {name}, which this "
                                 "model does not have")
            p, size = params[name], tuple(m.size)
            if name in experts and size[1:] == tuple(p.shape[1:]) and len(size) == p.dim():
                buf = torch.empty_like(p)
                stats[(name, stat)] = buf
                target[key] = _as_global(buf, mesh)
            else:
                dev = p.device if len(size) else torch.device("cpu")
                buf = torch.empty(size, dtype=m.properties.dtype, device=dev)
                stats[(name, stat)] = buf
                target[key] = buf
    with _one_process_quiet():
        dcp.load(target, checkpoint_id=path, process_group=process_group,
                 no_dist=mesh is None)
    # DTensor.from_local may have copied: write the loaded rows into the parameters
    with torch.no_grad():
        for name, p in experts.items():
            loaded = target[MODEL_PREFIX + name].to_local()
            if loaded.data_ptr() != p.data_ptr():
                p.copy_(loaded)
        for name, t in live.items():
            got = target[MODEL_PREFIX + name]
            if name not in experts and got.data_ptr() != t.data_ptr():
                t.copy_(got)
    if optimizer is None:
        return
    _set_optimizer_state(model, optimizer, groups_saved, stats)


def _set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         groups_saved: Optional[List[Mapping[str, Any]]],
                         stats: Mapping[Tuple[str, str], Tensor]) -> None:
    if groups_saved is None:
        raise ValueError("optimizer groups missing from the checkpoint's trainer state")
    names = _param_names(model, optimizer)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    position = {n: i for i, n in enumerate(order)}
    if sorted(n for g in groups_saved for n in g["params"]) != sorted(order):
        raise ValueError("the checkpoint's optimizer groups name other parameters than this "
                         "model's; resume with the model and optimizer it was saved with")
    param_groups = []
    for g in groups_saved:
        param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                             "params": [position[n] for n in g["params"]]})
    state: Dict[int, Dict[str, Any]] = {}
    for (name, stat), t in stats.items():
        state.setdefault(position[name], {})[stat] = t
    # the groups must list the indices in this optimizer's order
    if [p for g in param_groups for p in g["params"]] != list(range(len(order))):
        raise ValueError("the checkpoint's optimizer groups split the parameters otherwise "
                         "than this run's optimizer (another weight-decay rule?); resume "
                         "with the optimizer settings it was saved with")
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
