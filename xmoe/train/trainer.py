"""The training loop of `xmoe train`: one process or many under torchrun, CPU (gloo) or GPU (NCCL / RCCL).

Order of set-up (fixed, so every rank does the same thing):
  1. process group + device from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK)
  2. parallel dims -> one DeviceMesh (xmoe.parallel.dims); the one other group is the run guard's, for the
     stop-signal vote (xmoe.train.safety)
  3. data loader (``run.data``, sharded over data-parallel ranks); the checkpoint to resume, checked against this
     run's model, data and schedule from its meta.json before anything large is built; then the memory pre-flight
     (xmoe.train.preflight: the planner's peak against the device's free memory; ``fit``)
  4. the model through xmoe.parallel.build: on the meta device, parallelism applied from outside in a fixed order
     (TP (attention, dense FFN) -> SSMB -> EP + FSDP2 over the data-parallel ranks; pure data parallelism,
     ep = tp = 1, uses DDP), then only this rank's shards allocated and initialised from the seed (the same global
     values at any layout) or, with ``run.init_from``, read from a Hugging Face directory; recompute and compiled
     regions
  5. optimizer (xmoe.train.optim.build_optimizer: ``train.optimizer``), then the resumed checkpoint loaded straight
     into the local shards
Each step: gradient accumulation over micro-batches (bf16 autocast on GPUs, the routed experts' bf16 copies made
once per step, on one GPU by the previous step's Triton AdamW), clip and AdamW step (the clip inside AdamW's own
pass: xmoe.train.step), then the step's MoEStep finished (xmoe/moe/step.py: the auxiliary-loss-free bias update from
loads summed over all ranks, so the bias stays identical everywhere), metrics every ``log_every`` steps
(xmoe.train.report), the validation loss every ``eval_every`` steps and at the end when there is validation data
(``xmoe.train.evaluate``), an atomic checkpoint every ``ckpt_every`` steps and at the end.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from xmoe.config import RunConfig
from xmoe.kernels.choice import resolve_choice
from xmoe.moe.step import MoEStep, StepStats
from xmoe.parallel.build import build_model
from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.tensor import check_tensor_parallel
from xmoe.train import checkpoint as ckpt
from xmoe.train import metrics, oom, preflight, safety
from xmoe.train.determinism import deterministic_algorithms
from xmoe.train.launch import init_distributed
from xmoe.train.loader import TokenLoader
from xmoe.train.optim import build_optimizer, describe_optimizer, lr_at, param_groups
from xmoe.train.report import Reporter, Window
from xmoe.train.run_config import resolve_ep_overlap
from xmoe.train.run_data import keep_imported_files, load_run_data, validate
from xmoe.train.rundir import RunDir, RunDirError
from xmoe.train.step import clip_gradients, forward_backward, optimizer_step

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        out_dir: str | os.PathLike,
        device: str = "auto",
        resume: bool = False,
        *,
        overwrite: bool = False,
        resume_from: str | None = None,
        allow_changes: bool = False,
        fit: str = "off",
    ):
        """Train ``run`` (its model, schedule, layout, data and starting point) into ``out_dir``; the arguments
        are this invocation's. ``resume``: continue from the newest verified checkpoint in ``out_dir``
        (``resume_from``: from that checkpoint directory); a checkpoint whose model, data or schedule differ is
        refused unless ``allow_changes``. ``overwrite``: replace a run already in ``out_dir`` (else that is an
        error). ``fit``: the memory pre-flight's mode, "check", "auto" or "off" (preflight.check_run)."""
        self.run = run
        self.rank, self.world, self.device = init_distributed(device, run.parallel.timeout)
        resume = resume or resume_from is not None
        # every use of the run directory goes through this one object (rank 0 holds its lock)
        self.run_dir = RunDir.open(out_dir, resume=resume, overwrite=overwrite)
        self._restore_determinism: Callable[[], None] | None = None
        try:
            if run.train.deterministic:  # before anything runs on the GPU
                self._restore_determinism = deterministic_algorithms()
            if run.init_from and self.rank == 0:  # under the lock: a second trainer cannot interleave its copies
                keep_imported_files(run.init_from, self.out_dir)
            self._setup(run, resume, resume_from, allow_changes, fit)
        except BaseException:
            self.close()
            raise

    @property
    def out_dir(self) -> Path:
        """Where the run writes: its run directory, or the one a lost directory's rescue made."""
        return self.run_dir.path

    def close(self) -> None:
        """Release the run directory (train() does it when it ends; a run that has written nothing yet takes its
        partial outputs back and restores the run it was replacing) and torch's determinism setting as it was."""
        try:
            self.run_dir.close()
        finally:
            if self._restore_determinism is not None:
                self._restore_determinism()
                self._restore_determinism = None

    def _setup(self, run: RunConfig, resume: bool, resume_from: str | None, allow_changes: bool, fit: str) -> None:
        par = run.parallel
        if par.world_size != self.world:
            raise ValueError(
                f"dp x ep x tp = {par.dp} x {par.ep} x {par.tp} = {par.world_size} does not match the "
                f"{self.world} processes launched; launch {par.world_size} processes (torchrun --nproc-per-node) "
                "or change --dp/--ep/--tp"
            )
        if par.tp > 1:
            check_tensor_parallel(run.model, par.tp)  # heads (and dense FFN width) must split over tp
        self.dp_rank, self.dp_size = self._data_parallel_coords()
        t = run.train
        self.local_batch, self.micro_batch, _ = run.batch_layout()
        assert self.dp_size == run.parallel.dp * run.parallel.ep  # the ranks batch_layout split the batch over
        self.autocast = self.device.type == "cuda"
        self.kernel_choice = resolve_choice(run, self.device, torch.bfloat16 if self.autocast else torch.float32)

        # 1. the data (checked against the model's vocabulary)
        self._load_data(run)
        # 2. what a resume continues, checked against this run before anything large is built
        found = self._checkpoint_to_resume(resume_from, allow_changes) if resume else None
        # 3. the memory it needs, against what the device has free (after the resume check: a checkpoint of another
        # model is refused for that, not for the size of this one); --fit auto may change the micro-batch or recompute
        run = self._preflight(run, fit)
        t = run.train
        # 4. the model: built on the meta device, parallelised from outside, then only this rank's shards allocated
        # and initialised (layout-independent values from the seed, or init_from's weights); recompute and compiled
        # regions on the blocks
        torch.manual_seed(t.seed)
        built = build_model(
            run.model,
            self.device,
            self.dims,
            seed=t.seed,
            init_from=run.init_from,
            sequence_parallel=par.sequence_parallel,
            param_dtype=torch.bfloat16 if self.autocast else None,
            recompute=t.recompute,
            compile=t.compile,
            ep_overlap=run.parallel.ep_overlap,  # as resolved by the pre-flight
            ep_chunks=par.ep_chunks,
            kernels=run.kernels,  # resolved once, for this device, into the value every MoE layer is built with
        )
        self.model, self.wrapped, self.compiled = built.model, built.wrapped, built.compiled
        self.optimizer = build_optimizer(
            param_groups(self.wrapped, t.weight_decay),
            self.device,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            backend=self.kernel_choice.backend,  # moe.kernel_backend as resolved above
            copies=built.copy_writers,  # on one process: the experts' copies for the next step, written in its pass
            choice=t.optimizer,
        )
        self._params = [p for p in self.wrapped.parameters() if p.requires_grad]
        self.step = 0
        if found is not None:
            self._resume(found, resume_from is not None)
        self.logger = metrics.MetricsLogger(
            self.out_dir, self.rank, t.steps, tensorboard=t.tensorboard, resume_step=self.step if resume else None
        )
        self.report = Reporter(
            run,
            self.out_dir,
            self.logger,
            rank=self.rank,
            world=self.world,
            device=self.device,
            dataset=self.dataset,
            preset=run.preset,
            kernels=self.kernel_choice,
            optimizer=describe_optimizer(self.optimizer),
            memory=self.memory_line,
        )

    def _load_data(self, run: RunConfig) -> None:
        """The training data, its fingerprint (stored in checkpoints; a resume must match it), the validation
        windows, the loader (one loader step = one micro-batch on every data-parallel rank) and, for a mixture,
        the per-source loss counters (run_data.py)."""
        data = load_run_data(run, self.micro_batch, self.dp_rank, self.dp_size, self.device)
        self.dataset, self.data_info, self.val_sets = data.dataset, data.info, data.val_sets
        self.loader, self.source_losses = data.loader, data.source_losses

    def _preflight(self, run: RunConfig, mode: str) -> RunConfig:
        """The memory pre-flight (preflight.check_run): the run to train, --fit auto's change applied; then what
        overlaps the expert-parallel all-to-alls for the layout and batch it trains (``parallel.ep_overlap``)."""
        fitted, self.memory_line, self.planned = preflight.check_run(run, self.device, mode, warn=self.rank == 0)
        if fitted is not run:
            self.run = run = fitted
            self.local_batch, self.micro_batch, _ = run.batch_layout()
            self.loader = TokenLoader(  # the same sequences in the same order, in smaller micro-batches
                self.dataset, self.micro_batch * self.dp_size, self.dp_rank, self.dp_size, run.data.documents
            )
        self.run = run = resolve_ep_overlap(run, self.device.type)
        return run

    def _data_parallel_coords(self) -> tuple[int, int]:
        """This rank's index among the ranks that see different data, and how many there are."""
        par = self.run.parallel
        self.dims: ParallelDims | None = None
        if self.world == 1:
            return 0, 1
        self.dims = ParallelDims.from_config(par, self.world, rank=self.rank).build_mesh(self.device.type)
        # expert-parallel ranks see different tokens too: data is sharded over dp x ep
        return self.dims.coord("dp") * par.ep + self.dims.coord("ep"), par.dp * par.ep

    def _validate(self) -> dict[str, float]:
        assert self.val_sets is not None  # called only when the run has validation data
        return validate(
            self.wrapped, self.val_sets, self.micro_batch, self.device, self.dp_rank, self.dp_size, self.autocast
        )

    # ------------------------------------------------------------------------------------------ state

    def _checkpoint_to_resume(self, resume_from: str | None, allow_changes: bool) -> Path | None:
        """The checkpoint a resume continues (None: nothing saved yet), verified (sizes and crc32) and its stored
        model, data and schedule compared with this run's (RunDir.resume_checkpoint), before the model is built."""
        found = self.run_dir.resume_checkpoint(resume_from, self.run, self.data_info, allow_changes)
        if found is None and self.rank == 0:
            log.info(f"no checkpoint under {self.out_dir}/checkpoints: starting from step 0")
        return found

    def _resume(self, found: Path, chosen: bool) -> None:
        """Load ``found`` into the built model and optimizer (DCP writes straight into the local shards, the
        routers' expert_bias, a persistent buffer, included); ``chosen``: it was named by --resume-from, so later
        checkpoints of the run are set aside."""
        meta = self.run_dir.read_meta(found)
        saved_world = meta["world_size"]
        same_world = saved_world == self.world
        extra = ckpt.load_checkpoint(found, self.wrapped, self.optimizer, restore_extra=same_world, verify=False)
        if not same_world:
            # DCP resharded model and optimizer (experts too: they are saved under their full shape). The data
            # position is the same on every rank, so rank 0's copy serves; per-rank RNG streams restart, so the
            # continuation is equivalent but not bit-identical.
            extra = ckpt.read_extra(found, rank=0)
            if self.rank == 0:
                log.info(f"resuming a {saved_world}-process checkpoint on {self.world} processes")
        self.step = int(extra["step"])
        self.loader.load_state_dict(extra["loader"])
        if self.rank == 0:
            log.info(f"resumed from {found} at step {self.step}")
            if chosen:  # later checkpoints of this directory belong to the timeline being replaced
                self.run_dir.set_aside_newer(self.step)

    def save(self) -> Path:
        # the config as run, its data section with the fingerprint of the data it named (what a resume compares), and
        # the kernel choices as resolved on this device
        config = {
            **asdict(self.run),
            "data": {**asdict(self.run.data), **self.data_info},
            "kernels": self.kernel_choice.record(),
        }
        return ckpt.save_checkpoint(
            self.run_dir,
            self.step,
            self.wrapped,
            self.optimizer,
            {"step": self.step, "loader": self.loader.state_dict()},
            keep_last=self.run.train.keep_last,
            config=config,
        )

    # ------------------------------------------------------------------------------------------- loop

    def _forward_backward(self, accum: int) -> tuple[torch.Tensor, MoEStep]:
        return forward_backward(
            self.model,
            self.wrapped,
            self.loader,
            accum,
            self.device,
            self.autocast,
            source_losses=self.source_losses,
        )

    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.local_batch // self.micro_batch

    def train_step(
        self, accum: int, guard: safety.RunGuard | None = None
    ) -> tuple[torch.Tensor, StepStats, torch.Tensor, float]:
        """One optimizer step: forward and backward over ``accum`` micro-batches, clip, AdamW, then the MoE step's
        finish (the expert-bias update). Returns (mean loss, stats, grad norm, lr) as device tensors: nothing here
        reads them on the host. ``guard`` records a non-finite loss or gradient norm (and, under its skip policy,
        skips the update)."""
        t = self.run.train
        self.step += 1
        lr = lr_at(self.step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, moe = self._forward_backward(accum)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm, divisor = clip_gradients(self.optimizer, self._params, max_norm, self.dims)
        if guard is not None and guard.observe(self.step, loss, grad_norm, self.world):  # skip: update nothing
            self.optimizer.zero_grad(set_to_none=True)
            stats = moe.finish(update_bias=False)
            if guard.exhausted:
                first_bad = guard.check(self.world)[1]
                assert first_bad is not None  # an exhausted guard has recorded where the bad steps began
                self._stop_nonfinite(first_bad)
            return loss, stats, grad_norm, lr
        optimizer_step(self.optimizer, divisor)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, moe.finish(), grad_norm, lr

    def train(self) -> dict:
        """Run to ``train.steps``; raises safety.RunStopped after a stop signal (a checkpoint saved first) and
        safety.NonFiniteError on a NaN / inf loss or gradient norm (nothing saved after it)."""
        try:
            guard = safety.RunGuard(self.device, self.run.train.nonfinite_skips, self.run.parallel.timeout)
            with guard:
                return self._train(guard)
        except (RuntimeError, MemoryError) as exc:
            if not oom.is_out_of_memory(exc):
                raise
            self._stop_out_of_memory(exc)
        finally:
            self.close()

    def _train(self, guard: safety.RunGuard) -> dict:
        t = self.run.train
        accum = self.accumulation_steps()
        self.report.announce(self.model.num_params(), self.micro_batch, accum, self.dp_size, self.compiled, self.step)
        window = Window(self.device)
        due = False  # a scheduled checkpoint not yet written
        while self.step < t.steps:
            loss, stats, grad_norm, lr = self.train_step(accum, guard)
            window.add(stats)

            val = None
            if self.val_sets is not None and (self.step == t.steps or (t.eval_every and self.step % t.eval_every == 0)):
                evaluating = time.perf_counter()
                val = self._validate()
                window.exclude(evaluating)  # evaluation time is not training time
            log_now = self.step % t.log_every == 0 or self.step == t.steps
            # a save due inside a run of skipped non-finite steps waits for the first good step: those states are
            # the last good step's, and saving them would prune good checkpoints for copies
            due = due or (bool(t.ckpt_every) and self.step % t.ckpt_every == 0)
            ckpt_now = bool(t.ckpt_every) and (self.step == t.steps or (due and not guard.skipped_in_row))
            if log_now:
                sources = self.source_losses.take() if self.source_losses is not None else None
                mtp = self.model.take_mtp_loss()
                self.report.log_window(self.step, loss, stats.aux, grad_norm, lr, window, val, sources, mtp)
                self.run_dir.commit()  # a run this one replaces (--overwrite) can go now
                window = Window(self.device)
            elif val is not None:
                self.logger.log(self.step, **val)
            # rank 0 looks whether the run directory is still this run's before every save or log, and at most once
            # a second in between (two stats); a lost one stops every rank, as a signal does
            if self.run_dir.lost(now=ckpt_now or log_now):
                guard.lose_directory()
            # stop flags: the signal vote posted one step ago (several ranks), and both flags agreed where the step
            # already synchronises (one process: a signal at any step)
            signum = guard.vote()
            if log_now or ckpt_now or (self.world == 1 and guard.signalled()):
                checked, first_bad = guard.check(self.world)
                signum = signum or checked
                if first_bad is not None:
                    self._stop_nonfinite(first_bad)  # before saving: a non-finite state is never checkpointed
            if not signum:
                guard.start_vote()
            if signum == safety.DIR_LOST:
                self._stop_lost()
            if ckpt_now or (signum and t.ckpt_every):
                saving = time.perf_counter()
                self.save()
                self.run_dir.commit()  # a run this one replaces (--overwrite) can go now
                due = False
                window.exclude(saving)  # checkpoint time is not training time
            if signum:
                self._stop_signal(signum)
        summary = self.report.finish(self.step)
        if dist.is_initialized():
            dist.barrier()
        return summary

    def _stop_nonfinite(self, first_bad: int) -> None:
        last = self.run_dir.last_checkpoint(first_bad)
        where = (
            f"the last good checkpoint is {last} (continue from it with --resume-from {last})"
            if last
            else "no checkpoint was saved before it"
        )
        skips = self.run.train.nonfinite_skips
        when = (
            f"at step {first_bad}"
            if not skips
            else f"at step {first_bad} and stayed so through step {self.step}, more steps in a row than "
            f"train.nonfinite_skips={skips} lets skip"
        )
        fix = (
            "let up to N bad steps be skipped with --set train.nonfinite_skips=N"
            if not skips
            else "raise train.nonfinite_skips"
        )
        message = (
            f"the loss or gradient norm became non-finite {when} (lr {lr_at(first_bad, self.run.train):.3g}); "
            f"nothing from step {first_bad} on was saved and {where}. Lower --lr, check the data, or {fix}"
        )
        self.report.finish(self.step, status=f"stopped: non-finite loss or gradient norm at step {first_bad}")
        raise safety.NonFiniteError(message)

    def _stop_lost(self) -> None:
        """The run directory went (rank 0's lock saw it): nothing more is written at its path; the run's metrics,
        summary and a checkpoint go to a new directory beside it (RunDir.rescue, which moves the run there), and
        it stops."""
        why, rescue = self.run_dir.rescue(self.step)  # collective
        saved = bool(self.run.train.ckpt_every)
        if rescue is not None:
            self.report.out_dir = rescue
            self.logger.move_to(rescue)
            if self.rank == 0 and self.run.init_from:
                keep_imported_files(self.run.init_from, rescue)
            if saved:
                self.save()
            self.report.finish(self.step, status=f"stopped at step {self.step}: {why}")
        raise RunDirError(RunDir.rescue_text(why, rescue, self.step, saved))

    def _stop_out_of_memory(self, exc: BaseException) -> NoReturn:
        """One line naming the step, phase and last checkpoint (oom.stop_message); nothing is saved after it."""
        phase = oom.release(exc, self.device, self.optimizer)
        last = self.run_dir.last_checkpoint(self.step + 1)
        self.report.finish(self.step, status=f"stopped: out of memory at step {self.step} ({phase})")
        raise ValueError(oom.stop_message(self.run, self.device, self.step, phase, self.planned, last)) from exc

    def _stop_signal(self, signum: int) -> None:
        name = safety.signal_name(signum)
        saved = self.run_dir.last_checkpoint(self.step + 1) if self.run.train.ckpt_every else None
        self.report.finish(self.step, status=f"stopped by {name} at step {self.step}")
        raise safety.RunStopped(
            signum,
            f"stopped by {name} at step {self.step} of {self.run.train.steps}; "
            + (f"checkpoint {saved} saved: continue with --resume" if saved else "no checkpoint (--ckpt-every 0)"),
        )
