"""The :class:`Trainer`: builds every component of a run from its own config section and
runs the loop.

Order of a start (nothing is written into the run directory before set-up succeeded, so
a failed or interrupted start leaves the directory as it was):

1. checks that read only (:mod:`lrmoe.training.preflight`): the config,
   ``model.init_from`` / ``data.tokenizer`` paths, E divisible by the EP size, the
   torchrun group (:mod:`lrmoe.training.distributed`), the device, the run directory (a
   fresh run refuses one that holds a run) or the checkpoint (a resume refuses
   incompatible settings);
2. set-up (:mod:`lrmoe.training.setup`): device, data (:mod:`lrmoe.data`), model
   (transformers, patched by ``lrmoe.integrations.transformers.patch_moe_blocks``), optimizer
   (:mod:`lrmoe.training.optim`) with the placement's step hook
   (:class:`lrmoe.parallel.hooks.PlacementHooks`, the loop's one door into placement),
   batch stream (:mod:`lrmoe.training.batches`);
3. the run directory: stale ``.tmp-step-*`` saves removed, the files of an earlier run
   replaced (fresh) or the checkpoint's log restored (resume), metrics opened
   (:mod:`lrmoe.training.metrics`);
4. the loop: steps, evaluations, checkpoints (:mod:`lrmoe.training.checkpoint`), Ctrl-C;
5. a run that reached ``run.steps`` exports its last checkpoint to ``out_dir/export/``
   (``run.export``; :mod:`lrmoe.training.export`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

from lrmoe.parallel.hooks import (DataParallel, PlacementHooks, placement_from_config,
                                  reduce_and_clip_grads)
from lrmoe.parallel.state import (checkpoint_mesh, load_sharded_state, optimizer_groups,
                                  save_sharded_state)
from lrmoe.training import checkpoint as ckpt_io
from lrmoe.training import distributed as dist_io
from lrmoe.training import preflight, setup
from lrmoe.training.batches import BatchStream, micro_batches
from lrmoe.training.config import TrainConfig
from lrmoe.training.distributed import log
from lrmoe.training.export import EXPORT_DIR, export_checkpoint
from lrmoe.training.loss import autocast, causal_lm_nll, evaluate, lm_forward
from lrmoe.training.metrics import (CURVE_FILE, METRICS_FILE, SUMMARY_FILE, TENSORBOARD_DIR,
                                    MetricsLog, Progress, diagnostics_means_of, mean,
                                    print_summary, read_metrics, write_loss_curve)
from lrmoe.training.moe_timer import make_timer
from lrmoe.training.optim import build_optimizer, clip_in_step
from lrmoe.training.readout import PendingStep, StepReadout, snapshot_diagnostics
from lrmoe.training.run_lock import RunLock
from lrmoe.training.stop import StopSignals, stop_with_launcher

RUN_FILES = (METRICS_FILE, CURVE_FILE, SUMMARY_FILE)


@dataclass
class TrainResult:
    """What :meth:`Trainer.run` returns.

    Attributes:
        step: optimizer steps done (counting those before a resume).
        interrupted: stopped by Ctrl-C (a checkpoint was saved).
        out_dir: the run directory. checkpoint: the last checkpoint written (or None).
        summary: the final summary (also in ``summary.json``).
        model: the trained (patched) model. optimizer: its optimizer (after the last step).
        export: the folder of the plain transformers export (``run.export``), or None
            (stopped early, ``run.export`` false, or not rank 0).
    """

    step: int
    interrupted: bool
    out_dir: Path
    checkpoint: Optional[Path]
    summary: Dict[str, Any]
    model: Any = None
    optimizer: Any = None
    export: Optional[Path] = None


class Trainer:
    """One training run; see :func:`lrmoe.training.train.train`.

    Args:
        cfg: the run's config.
        resume: checkpoint directory to continue from, or None for a fresh run.
        overwrite: a fresh run may replace the run files already in ``run.out_dir``.
        step_callback: ``step_callback(trainer, step)`` after every step (tests, custom
            logging); ``trainer.request_stop()`` ends the run like Ctrl-C.

    Raises:
        FileExistsError: a fresh run into an ``out_dir`` that holds a run, without
            ``overwrite``.
        ValueError: a config incompatible with the checkpoint (names each field), a bad
            device, E not divisible by the EP size, a torchrun world size other than
            parallel.dp_size x parallel.ep_size or ranks started with other sizes, or a
            fresh run's ``out_dir`` that cannot be written (a file, a read-only place).
        FileNotFoundError: missing checkpoint, ``init_from`` or tokenizer.
    """

    def __init__(self, cfg: TrainConfig, *, resume: Optional[str | os.PathLike] = None,
                 overwrite: bool = False,
                 step_callback: Optional[Callable[["Trainer", int], None]] = None) -> None:
        cfg.validate()
        self.cfg, self.overwrite, self.step_callback = cfg, overwrite, step_callback
        self.tokenizer = preflight.check_inputs(cfg)
        # DP x EP: WORLD for the data-parallel sums, the mesh's ep group for the layers
        self.groups = dist_io.join(cfg.parallel.ep_size, cfg.run.device,
                                   cfg.parallel.dp_size)
        g = self.groups
        self.group, self.rank = (g.world, g.rank) if g is not None else (None, 0)
        self.ep_group, self.dp_group = (g.ep, g.dp) if g is not None else (None, None)
        self.ep_rank, self.dp_rank = (g.ep_rank, g.dp_rank) if g is not None else (0, 0)
        self.device = setup.resolve_device(dist_io.local_device(cfg.run.device))
        # ranks other than (ep 0, dp 0) keep their logs in out_dir/ep-rank-e[/dp-rank-d];
        # checkpoints are written by all ranks together into out_dir (checkpoint.py)
        self.out_dir = ckpt_io.rank_dir(cfg.run.out_dir, self.ep_rank, self.dp_rank)
        self.stop_requested = False
        self._stop_all = False  # expert parallel: some rank asked to stop (agreed)
        self.step = 0
        self.last_checkpoint: Optional[Path] = None
        self._last_saved_step = -1
        self._state: Optional[Dict[str, Any]] = None
        self.resume_from = Path(resume) if resume is not None else None
        if self.resume_from is not None:
            self._state, self.decay_steps = preflight.read_resume(self.resume_from, cfg)
        else:
            self.decay_steps = preflight.check_fresh(cfg, self.out_dir, overwrite)
        self._lock: Optional[RunLock] = None
        if self.out_dir.is_dir():  # refuse a second job before a long set-up
            self._take_lock()

    def _take_lock(self) -> None:
        """One job per run directory for the life of the process (every rank its folder;
        the OS frees the lock even after kill -9: :mod:`lrmoe.training.run_lock`).

        Raises:
            RunDirBusy (a FileExistsError): another live job holds it.
        """
        if self._lock is None:
            self._lock = dist_io.on_every_rank(self.group, self.rank,
                                               lambda: RunLock(self.out_dir),
                                               "locking its run folder")

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        from lrmoe.integrations.transformers import patch_moe_blocks

        cfg = self.cfg
        d = cfg.data
        self.autocast_dtype = setup.configure_device(cfg, self.device)
        t = time.perf_counter()
        self.data = dist_io.rank0_first(
            self.group, self.rank, lambda: setup.load_run_data(cfg, self.tokenizer),
            "loading the data")
        setup.report_run_data(cfg, self.data, time.perf_counter() - t)
        self.data_fingerprint = setup.data_fingerprint(self.data)
        if self._state is not None:
            setup.check_same_data(self._state["data_fingerprint"], self.data_fingerprint)
        source = self.resume_from or (Path(cfg.model.init_from) if cfg.model.init_from
                                      else None)
        # a resume's weights are loaded after the experts are sharded (each rank reads
        # its own rows), with the optimizer state
        self.model = setup.build_model(cfg, self.data, source,
                                       load_weights=self.resume_from is None)
        if cfg.run.attention != "sdpa":
            self.model.set_attn_implementation(cfg.run.attention)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        patched = patch_moe_blocks(self.model, cfg.backward, ep_group=self.ep_group,
                                   policy=placement_from_config(cfg.parallel))
        if not patched:
            raise ValueError(f"the model ({type(self.model).__name__}) has no sparse-MoE block "
                             "that lrmoe can replace")
        self.lrmoe_layers = dict(patched)
        self.placement = PlacementHooks(self.lrmoe_layers)
        self.trace = None
        if cfg.run.record_trace:
            from lrmoe.workload.trace import RoutingTrace
            hf = self.model.config
            self.trace = RoutingTrace(hf.num_experts, hf.num_experts_per_tok,
                                      cfg.run.trace_every)
            for index, (_, layer) in enumerate(patched):
                layer.trace, layer.layer_index = self.trace, index
        self.model.to(self.device)
        self.model.train()
        if cfg.run.compile:
            log(f"run.compile: {setup.compile_dense(self.model)} dense modules compiled "
                "(the first steps include the compilation)")
        # the planner's resident bytes (unless given): measured once, the same on every rank
        self.placement.set_up(cfg.parallel, self.device, self.group)
        self.moe_timer = make_timer(cfg.run.time_moe, self.model, self.device)
        self.readout = StepReadout(self.device, self.moe_timer, diagnostics_means_of)
        self.aux_coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.optimizer, self.scheduler = build_optimizer(cfg.optim, self.model, self.device,
                                                         self.decay_steps)
        # replica copies pushed after every optimizer step, for the policies that keep them
        self.placement.attach(self.optimizer)
        self.mesh = checkpoint_mesh(self.groups)
        if self._state is not None:
            load_sharded_state(str(self.resume_from / ckpt_io.STATE_DIR), self.model,
                               self.optimizer, self._state["optimizer_groups"], self.mesh,
                               self.group)
        # DDP over the non-expert parameters, the experts' own sum over dp
        self.data_parallel = (DataParallel(self.model, self.group, self.dp_group)
                              if self.group is not None else None)
        position = self._state["data_position"] if self._state is not None else {}
        self.stream = BatchStream(
            self.data.train, d.batch_size, cfg.run.seed,
            world=cfg.parallel.ep_size * cfg.parallel.dp_size,
            rank=self.rank, isolate_examples=d.isolate_examples,
            **{k: int(v) for k, v in position.items()})
        self.tokens_seen, self.elapsed_before = 0, 0.0
        if self._state is not None:
            self._load_state(self._state)

    def _load_state(self, state: Dict[str, Any]) -> None:
        # the model and optimizer tensors came in with load_sharded_state
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        counters = state["lrmoe_backward_steps"]
        for name, layer in self.lrmoe_layers.items():
            layer.stats.backward_steps = int(counters[name])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed_before = float(state["elapsed_s"])
        if "placement" in state:
            self.placement.load_state_dict(state["placement"])
        self._last_saved_step = self.step
        self.last_checkpoint = self.resume_from
        log(f"resumed from {self.resume_from} at step {self.step} (epoch "
            f"{self.stream.epoch}, batch {self.stream.index})")

    def _rank_rng(self) -> Dict[str, Any]:
        """This rank's RNG states from the checkpoint; a rank the saving run did not have
        takes those of rank ``rank % saved world`` (its random stream then differs from
        any straight run's)."""
        saved_world = int(self._state["ep_size"]) * int(self._state["dp_size"])
        own = ckpt_io.read_rank_state(self.resume_from, self.rank % saved_world)
        if own is None:
            raise FileNotFoundError(f"{self.resume_from}: no {ckpt_io.RANKS_DIR}/rank-"
                                    f"{self.rank % saved_world}.pt; the checkpoint is "
                                    "incomplete, resume an earlier one")
        return own["rng"]

    def _open_run_dir(self) -> None:
        """Set-up succeeded: from here on the run directory is written."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_io.remove_stale_saves(self.out_dir):
            log(f"removed {stale}, left by a save that was interrupted")
        metrics = self.out_dir / METRICS_FILE
        if self.resume_from is not None:
            # the log up to the checkpoint's step: the resumed file equals a straight run's
            own = (self.resume_from / METRICS_FILE if self.rank == 0 else
                   self.resume_from / ckpt_io.RANKS_DIR / f"metrics-rank-{self.rank}.jsonl")
            if own.is_file():
                shutil.copyfile(own, metrics)
            else:  # a rank the checkpoint's run did not have
                metrics.write_text("")
        else:
            for name in RUN_FILES:
                (self.out_dir / name).unlink(missing_ok=True)
            for name in ("checkpoints", TENSORBOARD_DIR, EXPORT_DIR):
                shutil.rmtree(self.out_dir / name, ignore_errors=True)
            metrics.write_text("")
        tb = self.out_dir / TENSORBOARD_DIR if self.cfg.run.tensorboard and self.rank == 0 \
            else None
        self.metrics = MetricsLog(metrics, tb, purge_step=self.step + 1 if self.step else None)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-XXXXXXXX`` atomically, all ranks together (rank 0 the
        run's files, every rank its rows of the DCP state and its RNG) and keep the newest
        ``run.keep_checkpoints``. Returns the checkpoint directory (on every rank)."""
        self.metrics.flush()
        metrics = self.out_dir / METRICS_FILE
        root = Path(self.cfg.run.out_dir)
        name = f"{ckpt_io.CHECKPOINT_PREFIX}{self.step:08d}"
        tmp = root / "checkpoints" / f".tmp-{name}"
        run_all = functools.partial(dist_io.on_every_rank, self.group, self.rank)
        run_all(lambda: ckpt_io.begin_save(root, self.step) if self.rank == 0 else None,
                "preparing a checkpoint folder")

        def write_own() -> None:
            save_sharded_state(str(tmp / ckpt_io.STATE_DIR), self.model, self.optimizer,
                               self.mesh, self.group)
            ckpt_io.write_rank_files(tmp, self.rank, metrics)

        run_all(write_own, "saving a checkpoint")
        state = {
            "format": 2, "step": self.step,
            "optimizer_groups": optimizer_groups(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(), "data_position": self.stream.position(),
            "lrmoe_backward_steps": {n: int(l.stats.backward_steps)
                                     for n, l in self.lrmoe_layers.items()},
            "lr_decay_steps": int(self.decay_steps), "tokens_seen": int(self.tokens_seen),
            "elapsed_s": float(self.elapsed_before + time.perf_counter() - self._t_start),
            "metrics_bytes": int(metrics.stat().st_size),
            "data_fingerprint": self.data_fingerprint,
            "ep_size": int(self.cfg.parallel.ep_size), "dp_size": int(self.cfg.parallel.dp_size)}
        if self.placement.active:  # symi plans from the last step's loads (the same on
            state["placement"] = self.placement.state_dict()  # every rank)
        final = run_all(lambda: ckpt_io.finish_save(
            tmp, model=self.model, cfg=self.cfg, state=state,
            tokenizer_path=self.data.tokenizer_path, metrics_path=metrics,
            keep=self.cfg.run.keep_checkpoints) if self.rank == 0 else
            root / "checkpoints" / name, "saving a checkpoint")
        self._last_saved_step, self.last_checkpoint = self.step, final
        return final

    def export(self) -> Optional[Path]:
        """Export the last checkpoint to ``run.out_dir/export/`` (replacing an earlier
        export) as a plain transformers checkpoint; rank 0 writes it, after every rank has
        saved its shard. Returns the folder on rank 0, None on the others.

        Raises:
            what :func:`lrmoe.training.export.export_checkpoint` raises, on rank 0; a
            RuntimeError on the other ranks when rank 0 failed.
        """
        target = Path(self.cfg.run.out_dir) / EXPORT_DIR
        done = dist_io.on_every_rank(
            self.group, self.rank, lambda: export_checkpoint(
                self.last_checkpoint, target, overwrite=True) if self.rank == 0 else None,
            "exporting the model")
        if done is not None:
            log(f"exported step {self.step} to {done} (a plain transformers checkpoint: "
                "AutoModelForCausalLM / AutoTokenizer.from_pretrained load it)")
        return done

    # ------------------------------------------------------------------ signals
    def request_stop(self) -> None:
        """End the run after the current step, with a checkpoint (what Ctrl-C does)."""
        self.stop_requested = True

    def _stop_agreed(self) -> bool:
        # under EP every rank stops after the same step: the flags ride on the step's
        # loss all-reduce (distributed.reduce_step_totals)
        return self._stop_all if self.group is not None else self.stop_requested

    # ------------------------------------------------------------------ the loop
    def _train_step(self, log_step: bool) -> PendingStep:
        """Queue one optimizer step; its numbers are read a step later
        (:mod:`lrmoe.training.readout`). ``log_step``: stage the MoE diagnostics too."""
        cfg = self.cfg
        start = self.readout.clock.event()
        micro, tokens = micro_batches(self.stream, cfg.data.grad_accum)
        num_loss = sum(b.num_loss_tokens() for b in micro)
        denom = max(num_loss, 1)
        self.optimizer.zero_grad(set_to_none=True)
        nll_total = torch.zeros((), dtype=torch.float32, device=self.device)
        aux_total: Optional[Tensor] = None
        timing = self.moe_timer.armed() if self.moe_timer else contextlib.nullcontext()
        dp = self.data_parallel
        with timing:
            for i, batch in enumerate(micro):
                batch = batch.to(self.device)
                # the gradient sync runs in the last micro-batch's backward (overlapped)
                accumulate = dp.no_sync() if dp is not None and i < len(micro) - 1 \
                    else contextlib.nullcontext()
                with accumulate:
                    with autocast(self.device, self.autocast_dtype):
                        logits, aux = lm_forward(self.model, batch, aux_loss=True,
                                                 wrapper=dp.module if dp is not None else None)
                    nll, _ = causal_lm_nll(logits, batch.labels_BS)
                    loss = nll / denom
                    if aux is not None:
                        loss = loss + self.aux_coef * aux / cfg.data.grad_accum
                        aux_total = aux.detach() if aux_total is None else \
                            aux_total + aux.detach()
                    loss.backward()
                nll_total += nll.detach()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        if self.group is not None:
            # loss = mean of the ranks' losses: average dense grads, scale expert grads
            grad_norm = reduce_and_clip_grads(self.model, max_norm, dp, self.ep_group)
            nll_total, num_loss, stop = dist_io.reduce_step_totals(
                self.group, nll_total, num_loss, self.stop_requested)
            if stop:
                self._stop_all = self.stop_requested = True
            denom = max(num_loss, 1)
        else:
            grad_norm = clip_in_step(self.optimizer, self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()  # its post-hook pushes replica copies (PlacementHooks.attach)
        self.scheduler.step()
        self.step += 1
        if self.trace is not None:
            self.trace.step = self.step
        self.tokens_seen += tokens
        diagnostics, extra = None, None
        if log_step:
            from lrmoe.integrations.transformers import collect_diagnostics

            # replica placement's statistics are read now (snapshot_diagnostics: None)
            diagnostics = snapshot_diagnostics(self.model) or collect_diagnostics(self.model)
            extra = self.placement.metrics()
        record = {"kind": "train", "step": self.step, "lr": lr, "tokens": tokens,
                  "loss_tokens": num_loss}
        return self.readout.stage(start, record, nll_total, aux_total, grad_norm, denom,
                                  cfg.data.grad_accum, diagnostics, extra)

    def _log_step(self, step: int) -> bool:
        return step % self.cfg.run.log_every == 0 or step == self.cfg.run.steps

    def _finished(self, record: Optional[Dict[str, Any]], progress: Progress) -> None:
        """A step's record, read a step late: checked, logged, shown."""
        if record is None:
            return
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(
                f"step {record['step']}: the loss is {record['loss']}; lower optim.lr (now "
                f"{self.cfg.optim.lr}) or raise optim.warmup_steps")
        if self._log_step(record["step"]):
            self._records.append(record)
            self.metrics.write(record)
        progress.update(record["step"], self.cfg.run.steps, record)

    def _evaluate(self, progress: Optional[Progress]) -> Dict[str, Any]:
        cfg = self.cfg
        res = evaluate(self.model, self.data.val, cfg.data.batch_size, cfg.run.eval_batches,
                       self.device, self.autocast_dtype, cfg.data.isolate_examples)
        record = {"kind": "eval", "step": self.step, **res}
        self.metrics.write(record)
        self._evals.append(record)
        text = f"step {self.step}: validation loss {res['val_loss']:.4f}, ppl {res['val_ppl']:.2f}"
        progress.write(text) if progress is not None else log(text)
        write_loss_curve(self.out_dir / METRICS_FILE, self.out_dir / CURVE_FILE,
                         title=self._plot_title())
        return record

    def _plot_title(self) -> str:
        c = self.cfg
        return (f"{Path(c.run.out_dir).name}: c={c.lrmoe.recalibration_rate:g}, "
                f"metric={c.lrmoe.metric}")

    def run(self) -> TrainResult:
        """Set up, train to ``run.steps`` (or Ctrl-C), save, summarise. torch's thread
        count is restored afterwards."""
        threads = torch.get_num_threads()
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)
            if getattr(self, "data_parallel", None) is not None:
                self.data_parallel.close()
                self.data_parallel = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _run(self) -> TrainResult:
        self._setup()
        cfg, steps = self.cfg, self.cfg.run.steps
        if self.resume_from is not None and self.step >= steps:
            # nothing to train: leave the finished run's metrics and summary as they are
            log(f"the run in {self.out_dir} is complete at step {self.step} (run.steps="
                f"{steps}); pass --steps N with N > {self.step} to train further")
            summary_file = self.out_dir / SUMMARY_FILE
            summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            return TrainResult(self.step, False, self.out_dir, self.resume_from, summary,
                               self.model)
        self._take_lock()  # a new folder is made only now, after set-up
        self._open_run_dir()
        self._t_start = time.perf_counter()
        self._evals: List[Dict[str, Any]] = []
        self._records: List[Dict[str, Any]] = []
        start_step, interrupted = self.step, False
        progress: Optional[Progress] = None
        signals = StopSignals(self.request_stop, log)
        signals.install()
        if self.group is not None and dist_io.under_torchrun() and stop_with_launcher():
            log("the launcher (torchrun) is gone: stopping after the first step")
            self.request_stop()
        try:
            if self._state is not None:
                ckpt_io.set_rng_state(self._rank_rng())
            else:
                self._evaluate(None)
            progress = Progress(cfg.run.progress if self.rank == 0 else "none", steps,
                                self.step, cfg.run.log_every)
            s = cfg.lrmoe
            log(f"training steps {self.step + 1}..{steps} on {self.device} "
                f"({'bf16 autocast' if self.autocast_dtype else 'float32'}); LRMoE "
                f"c={s.recalibration_rate:g} metric={s.metric} quota={s.quota_rule} "
                f"selection={s.selection}; Ctrl-C or SIGTERM saves and stops")
            try:
                while self.step < steps and not self._stop_agreed():
                    # step N's numbers are read after step N + 1 is queued (readout.py)
                    pending = self._train_step(self._log_step(self.step + 1))
                    self._finished(self.readout.push(pending), progress)
                    evaluate_now = cfg.run.eval_every and self.step % cfg.run.eval_every == 0
                    save_now = cfg.run.checkpoints and cfg.run.save_every and \
                        self.step % cfg.run.save_every == 0
                    if evaluate_now or save_now:  # a non-finite loss is never saved
                        self._finished(self.readout.flush(gap=True), progress)
                    if evaluate_now:
                        self._evaluate(progress)
                    if self.step_callback is not None:
                        self.step_callback(self, self.step)
                    if save_now:
                        self.save_checkpoint()
                self._finished(self.readout.flush(), progress)
            except BaseException as err:
                # the last queued step's record is kept where it can still be read; its
                # non-finite loss, if any, is the earlier cause (a router then sees NaN)
                try:
                    self._finished(self.readout.flush(), progress)
                except FloatingPointError as nan:
                    raise nan from err
                except Exception:
                    pass
                raise
            interrupted = self.stop_requested and self.step < steps
            if cfg.run.checkpoints and self._last_saved_step != self.step:
                self.save_checkpoint()
            if not interrupted and not (self._evals and self._evals[-1]["step"] == self.step):
                self._evaluate(progress)  # after the checkpoint: a resume drops this line
        finally:
            signals.restore()
            if progress is not None:
                progress.close()
            self.metrics.close()
        if self.trace is not None and self.trace.records:
            log(f"routing trace: {self.trace.save(cfg.run.record_trace)}")
        write_loss_curve(self.out_dir / METRICS_FILE, self.out_dir / CURVE_FILE,
                         title=self._plot_title())
        summary = self._summary(start_step, interrupted)
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if self.rank == 0:
            print_summary(summary)
        exported = (self.export() if cfg.run.export and cfg.run.checkpoints and not interrupted
                    else None)
        if interrupted:
            ep, dp = cfg.parallel.ep_size, cfg.parallel.dp_size
            flags = f"--ep {ep}" if dp == 1 else f"--dp {dp} --ep {ep}"
            launch = (f"torchrun --nproc-per-node {ep * dp} -m lrmoe train {flags}"
                      if self.group is not None else "lrmoe train")
            log(f"interrupted at step {self.step}; checkpoint {self.last_checkpoint}. "
                f"Continue with: {launch} --out {cfg.run.out_dir} --resume")
        return TrainResult(step=self.step, interrupted=interrupted, out_dir=self.out_dir,
                           checkpoint=self.last_checkpoint, summary=summary, model=self.model,
                           optimizer=self.optimizer, export=exported)

    def _summary(self, start_step: int, interrupted: bool) -> Dict[str, Any]:
        wall = time.perf_counter() - self._t_start
        evals = [r for r in read_metrics(self.out_dir / METRICS_FILE) if r["kind"] == "eval"]
        run_tokens = sum(r["tokens"] for r in self._records)
        if self.device.type == "cuda":
            # The card's name: lent machines change between sessions (H100 / H200) and a
            # table must never mix timings of two cards unknowingly.
            memory = {"peak_cuda_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                      "device_name": torch.cuda.get_device_name(self.device)}
        else:
            memory = {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        train_time = sum(r["time_s"] for r in self._records)
        moe = [r["moe_time_ms"] for r in self._records if "moe_time_ms" in r]
        if moe:  # this run's logged steps (run.time_moe)
            memory["moe_time_s"] = sum(moe) / 1e3
        return {
            "steps": self.step, "steps_this_run": self.step - start_step,
            "interrupted": interrupted, "tokens": self.tokens_seen, "wall_time_s": wall,
            "tokens_per_s": run_tokens / train_time if train_time > 0 else None,
            "params_millions": self.num_params / 1e6,
            "first_val_ppl": evals[0]["val_ppl"] if evals else None,
            "first_val_step": evals[0]["step"] if evals else None,
            "last_val_ppl": evals[-1]["val_ppl"] if evals else None,
            "last_val_step": evals[-1]["step"] if evals else None,
            "last_train_loss": self._records[-1]["loss"] if self._records else None,
            "dropped_fraction": mean([r.get("dropped_fraction") for r in self._records]),
            "retained_mass": mean([r.get("retained_mass") for r in self._records]),
            "device": str(self.device), **memory,
            "recalibration_rate": self.cfg.lrmoe.recalibration_rate,
            "metric": self.cfg.lrmoe.metric, "out_dir": str(self.out_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
