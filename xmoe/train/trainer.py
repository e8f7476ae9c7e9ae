"""The training loop of `xmoe train`: one process or many under torchrun, CPU (gloo) or GPU (NCCL / RCCL).

Order of set-up (fixed, so every rank does the same thing):
  1. process group + device from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK)
  2. parallel dims -> one DeviceMesh (xmoe.parallel.dims); nothing else creates groups
  3. data loader (sharded over data-parallel ranks); the checkpoint to resume, checked against this run's model,
     data and schedule from its meta.json before anything large is built
  4. the model through xmoe.parallel.build: on the meta device, parallelism applied from outside in a fixed order
     (TP (attention, dense FFN) -> SSMB -> EP + FSDP2 over the data-parallel ranks; pure data parallelism,
     ep = tp = 1, uses DDP), then only this rank's shards allocated and initialised from the seed (the same global
     values at any layout) or, with ``init_from``, read from a Hugging Face directory; recompute and compiled regions
  5. optimizer, then the resumed checkpoint loaded straight into the local shards
Each step: gradient accumulation over micro-batches (bf16 autocast on GPUs, the routed experts' bf16 copies made
once per step), clip,
AdamW step, auxiliary-loss-free bias update (loads summed over data-parallel ranks so the bias stays identical
everywhere), metrics every ``log_every`` steps, the validation loss every ``eval_every`` steps and at the end when
there is validation data (``xmoe.train.evaluate``), an atomic checkpoint every ``ckpt_every`` steps and at the end.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from xmoe.config import RunConfig
from xmoe.kernels.choice import resolve_choice
from xmoe.parallel.build import build_model
from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.expert_parallel import clip_grad_norm_
from xmoe.parallel.grads import set_accumulation_scale
from xmoe.parallel.tensor import check_tensor_parallel
from xmoe.train import checkpoint as ckpt
from xmoe.train import checkpoint_dir
from xmoe.train import metrics, rundir, safety
from xmoe.train.resume import fingerprint, resume_checkpoint
from xmoe.train.step import forward_backward, update_expert_bias
from xmoe.train.data import TokenLoader, build_dataset
from xmoe.train.evaluate import evaluate, validation_split, validation_windows

log = logging.getLogger(__name__)


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the process group the launcher describes (if any); return (rank, world_size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise ValueError(f"--device ({device!r}) must be auto, cpu or cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no GPU; use --device cpu")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, dev


def lr_at(step: int, run: RunConfig) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    t = run.train
    if step <= t.warmup_steps:
        return t.lr * step / max(1, t.warmup_steps)
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and expert weight stacks); never norms or other 1-D parameters."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _keep_imported_files(hf_dir: str, out: Path) -> None:
    """Copy the imported config.json (export reuses its other fields) and tokenizer.json (text data, eval and
    generate use it) into the run directory."""
    import shutil

    from xmoe.hf.checkpoint import RUN_HF_CONFIG, RUN_TOKENIZER

    shutil.copy(Path(hf_dir) / "config.json", out / RUN_HF_CONFIG)
    if (Path(hf_dir) / RUN_TOKENIZER).is_file():
        shutil.copy(Path(hf_dir) / RUN_TOKENIZER, out / RUN_TOKENIZER)


class Trainer:
    def __init__(self, run: RunConfig, out_dir: str | os.PathLike, data: str = "markov",
                 device: str = "auto", resume: bool = False, *, init_from: Optional[str] = None,
                 val_data: Optional[str] = None, tokenizer: str = "bytes", overwrite: bool = False,
                 resume_from: Optional[str] = None, allow_changes: bool = False, preset: str = ""):
        """``init_from``: a Hugging Face directory whose weights replace the initialisation (``run.model`` must be
        its architecture); ``val_data``: a validation data spec (else ``val_fraction`` of ``data`` is held out);
        ``tokenizer``: for .txt data, "bytes" or a tokenizers JSON file. ``resume``: continue from the newest
        verified checkpoint in ``out_dir`` (``resume_from``: from that checkpoint directory); a checkpoint whose
        model, data or schedule differ is refused unless ``allow_changes``. ``overwrite``: replace a run already in
        ``out_dir`` (else that is an error)."""
        self.run, self.out_dir, self.data_spec, self.preset = run, Path(out_dir), data, preset
        self.rank, self.world, self.device = init_distributed(device)
        resume = resume or resume_from is not None
        self.lock = rundir.open_run_dir(self.out_dir, rank=self.rank, resume=resume, overwrite=overwrite)
        try:
            if init_from and self.rank == 0:  # under the lock: a second trainer cannot interleave its copies
                _keep_imported_files(init_from, self.out_dir)
            self._setup(run, data, resume, resume_from, allow_changes, init_from, val_data, tokenizer)
        except BaseException:
            self.close()
            raise

    def _wrote_output(self) -> None:
        """This run has written a log line or a checkpoint: a run it replaces (--overwrite) can go now."""
        if self.lock is not None:
            self.lock.commit()

    def close(self) -> None:
        """Release the run directory (train() does it when it ends; a run that has written nothing yet takes its
        partial outputs back and restores the run it was replacing)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _setup(self, run: RunConfig, data: str, resume: bool, resume_from: Optional[str], allow_changes: bool,
               init_from: Optional[str], val_data: Optional[str], tokenizer: str) -> None:
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
        self.kernels = resolve_choice(run, self.device, torch.bfloat16 if self.autocast else torch.float32)

        # 1. the data (checked against the model's vocabulary)
        self.dataset = dataset = build_dataset(data, seq_len=t.seq_len, vocab_size=run.model.vocab_size, seed=t.seed,
                                               tokenizer=tokenizer)
        self.data_info = fingerprint(data, dataset)  # stored in checkpoints; a resume must match it
        self.val_windows = None
        if val_data is not None and t.val_fraction > 0:
            raise ValueError(f"--val-data ({val_data}) and val_fraction ({t.val_fraction}) both choose validation "
                             "data; pass one of them")
        if val_data is not None:
            self.val_windows = validation_windows(val_data, t.seq_len, run.model.vocab_size, t.val_windows, t.seed,
                                                  tokenizer)
        elif t.val_fraction > 0:
            dataset, self.val_windows = validation_split(dataset, t.val_fraction, t.val_windows)
            self.dataset = dataset
        # one loader step = one micro-batch on every data-parallel rank
        self.loader = TokenLoader(dataset, self.micro_batch * self.dp_size, rank=self.dp_rank,
                                  world_size=self.dp_size)

        # 2. what a resume continues, checked against this run before anything large is built
        found = self._checkpoint_to_resume(resume_from, allow_changes) if resume else None
        # 3. the model: built on the meta device, parallelised from outside, then only this rank's shards allocated
        # and initialised (layout-independent values from the seed, or init_from's weights); recompute and compiled
        # regions on the blocks
        torch.manual_seed(t.seed)
        built = build_model(run.model, self.device, self.dims, seed=t.seed, init_from=init_from,
                            sequence_parallel=par.sequence_parallel,
                            param_dtype=torch.bfloat16 if self.autocast else None,
                            recompute=t.recompute, compile=t.compile)
        self.model, self.wrapped, self.compiled = built.model, built.wrapped, built.compiled
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.wrapped, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
            fused=self.device.type == "cuda",
        )
        self._params = [p for p in self.wrapped.parameters() if p.requires_grad]
        self.step = 0
        if found is not None:
            self._resume(found, resume_from is not None)
        self.logger = metrics.MetricsLogger(self.out_dir, self.rank, t.steps, tensorboard=t.tensorboard,
                                            resume_step=self.step if resume else None)
        self.flop_dims = metrics.FlopDims.from_model_config(run.model, t.seq_len)

    def _data_parallel_coords(self) -> tuple[int, int]:
        """This rank's index among the ranks that see different data, and how many there are."""
        par = self.run.parallel
        self.dims: Optional[ParallelDims] = None
        if self.world == 1:
            return 0, 1
        self.dims = ParallelDims.from_config(par, self.world, rank=self.rank).build_mesh(self.device.type)
        # expert-parallel ranks see different tokens too: data is sharded over dp x ep
        return self.dims.coord("dp") * par.ep + self.dims.coord("ep"), par.dp * par.ep

    def _validate(self) -> float:
        return evaluate(self.wrapped, self.val_windows, self.micro_batch, self.device, self.dp_rank, self.dp_size,
                        autocast=self.autocast)["loss"]

    # ------------------------------------------------------------------------------------------ state

    def _checkpoint_to_resume(self, resume_from: Optional[str], allow_changes: bool) -> Optional[Path]:
        """The checkpoint a resume continues (None: nothing saved yet), verified (sizes and crc32) and its stored
        model, data and schedule compared with this run's (resume.resume_checkpoint), before the model is built."""
        found = resume_checkpoint(self.out_dir, resume_from, self.run, self.data_info, allow_changes)
        if found is None and self.rank == 0:
            log.info(f"no checkpoint under {self.out_dir}/checkpoints: starting from step 0")
        return found

    def _resume(self, found: Path, chosen: bool) -> None:
        """Load ``found`` into the built model and optimizer (DCP writes straight into the local shards);
        ``chosen``: it was named by --resume-from, so later checkpoints of the run are set aside."""
        meta = ckpt.read_meta(found)
        saved_world = meta["world_size"]
        same_world = saved_world == self.world
        extra = ckpt.load_checkpoint(found, self.wrapped, self.optimizer, restore_extra=same_world, verify=False)
        if not same_world:
            # DCP resharded model and optimizer (experts too: they are saved under their full shape). The data
            # position and the expert bias are the same on every rank, so rank 0's copy serves; per-rank RNG
            # streams restart, so the continuation is equivalent but not bit-identical.
            extra = ckpt.read_extra(found, rank=0)
            if self.rank == 0:
                log.info(f"resuming a {saved_world}-process checkpoint on {self.world} processes")
        self.step = int(extra["step"])
        self.loader.load_state_dict(extra["loader"])
        for layer, bias in zip(self.model.moe_layers(), extra.get("expert_bias", [])):
            layer.router.expert_bias.copy_(bias)
        if self.rank == 0:
            log.info(f"resumed from {found} at step {self.step}")
            if chosen:  # later checkpoints of this directory belong to the timeline being replaced
                for path in checkpoint_dir.set_aside_newer(self.out_dir, self.step):
                    log.info(f"set aside {path.parent.name}/{path.name.split('.')[0]} (newer than the resumed step) "
                             f"as {path.name}")

    def save(self) -> Path:
        extra = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "expert_bias": [layer.router.expert_bias.detach().cpu() for layer in self.model.moe_layers()],
        }
        return ckpt.save_checkpoint(self.out_dir, self.step, self.wrapped, self.optimizer, extra,
                                    keep_last=self.run.train.keep_last,
                                    config={**asdict(self.run), "data": self.data_info,
                                            "kernels": self.kernels.record()})

    # ------------------------------------------------------------------------------------------- loop

    def _forward_backward(self, accum: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return forward_backward(self.model, self.wrapped, self.loader, accum, self.device, self.autocast,
                                detach_casts=self.world == 1)

    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank; also sets the MoE layers' aux-loss scale to match."""
        accum = self.local_batch // self.micro_batch
        set_accumulation_scale(self.model, accum)  # the LM loss is backpropagated as loss / accum too
        return accum

    def train_step(self, accum: int, guard: Optional[safety.RunGuard] = None
                   ) -> tuple[torch.Tensor, dict, torch.Tensor, float]:
        """One optimizer step: forward and backward over ``accum`` micro-batches, clip, AdamW, expert-bias update.
        Returns (mean loss, stats, grad norm, lr) as device tensors: nothing here reads them on the host. ``guard``
        records a non-finite loss or gradient norm (and, under its skip policy, skips the update)."""
        t = self.run.train
        self.step += 1
        lr = lr_at(self.step, self.run)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, stats = self._forward_backward(accum)
        grad_norm = clip_grad_norm_(self._params, t.grad_clip if t.grad_clip > 0 else float("inf"), dims=self.dims)
        if guard is not None and guard.observe(self.step, loss, grad_norm, self.world):  # skip: update nothing
            self.optimizer.zero_grad(set_to_none=True)
            if guard.exhausted:
                self._stop_nonfinite(guard.check(self.world)[1])
            return loss, stats, grad_norm, lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_expert_bias(self.model, stats["load"])
        return loss, stats, grad_norm, lr

    def train(self) -> dict:
        """Run to ``train.steps``; raises safety.RunStopped after a stop signal (a checkpoint saved first) and
        safety.NonFiniteError on a NaN / inf loss or gradient norm (nothing saved after it)."""
        try:
            with safety.RunGuard(self.device, self.run.train.nonfinite_skips) as guard, self.kernels.applied():
                return self._train(guard)
        finally:
            self.close()

    def _train(self, guard: safety.RunGuard) -> dict:
        t = self.run.train
        accum = self.accumulation_steps()
        if self.rank == 0:
            self._announce(accum)
        window_start, window_steps = time.perf_counter(), 0
        window_rows = torch.zeros((), dtype=torch.long, device=self.device)
        window_load = None
        due = False  # a scheduled checkpoint not yet written
        while self.step < t.steps:
            loss, stats, grad_norm, lr = self.train_step(accum, guard)
            window_steps += 1
            window_rows += stats["rows"]
            if stats["load"] is not None:
                window_load = stats["load"] if window_load is None else window_load + stats["load"]

            val_loss = None
            if self.val_windows is not None and (self.step == t.steps or (t.eval_every and
                                                                          self.step % t.eval_every == 0)):
                evaluating = time.perf_counter()
                val_loss = self._validate()
                window_start += time.perf_counter() - evaluating  # evaluation time is not training time
            log_now = self.step % t.log_every == 0 or self.step == t.steps
            # a save due inside a run of skipped non-finite steps waits for the first good step: those states are
            # the last good step's, and saving them would prune good checkpoints for copies
            due = due or (bool(t.ckpt_every) and self.step % t.ckpt_every == 0)
            ckpt_now = bool(t.ckpt_every) and (self.step == t.steps or due and not guard.skipped_in_row)
            if log_now:
                self._log(loss, stats["aux"], grad_norm, lr, window_steps, window_rows, window_load, window_start,
                          val_loss)
                self._wrote_output()
                window_start, window_steps = time.perf_counter(), 0
                window_rows = torch.zeros_like(window_rows)
                window_load = None
            elif val_loss is not None:
                self.logger.log(self.step, val_loss=val_loss)
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
            if ckpt_now or (signum and t.ckpt_every):
                saving = time.perf_counter()
                self.save()
                self._wrote_output()
                due = False
                window_start += time.perf_counter() - saving  # checkpoint time is not training time
            if signum:
                self._stop_signal(signum)
        summary = self._finish()
        if dist.is_initialized():
            dist.barrier()
        return summary

    def _finish(self, status: Optional[str] = None) -> dict:
        """summary.json, loss.png and the list of outputs; ``status`` says why a run ended early."""
        floor = getattr(self.dataset, "loss_floor", None)
        summary = self.logger.finish(floor=floor, baseline=getattr(self.dataset, "unigram_entropy", None),
                                     status=status, title=f"{self.out_dir} ({self._preset_text()})", step=self.step,
                                     info={"kernels": self.kernels.record()})
        if self.rank == 0:
            if floor is not None and isinstance(summary.get("final_loss"), float):
                log.info(f"final loss {summary['final_loss']:.3f}: {summary['final_loss'] - floor:.3f} nats/token "
                         f"above the source's floor {floor:.3f} (unigram baseline {self.dataset.unigram_entropy:.3f})")
            log.info(metrics.describe_outputs(self.out_dir))
        return summary

    def _preset_text(self) -> str:
        m = self.run.model
        preset = f"preset {self.preset}, " if self.preset else ""
        return (f"{preset}{m.num_layers} layers, H {m.hidden_size}, {m.moe.num_experts} experts top-{m.moe.top_k}, "
                f"data {self.dataset.name.split('(')[0]}")

    def _last_good_checkpoint(self, before: int) -> Optional[Path]:
        good = [p for s, p in checkpoint_dir.complete_checkpoints(self.out_dir) if s < before]
        return good[-1] if good else None

    def _stop_nonfinite(self, first_bad: int) -> None:
        last = self._last_good_checkpoint(first_bad)
        where = (f"the last good checkpoint is {last} (continue from it with --resume-from {last})" if last
                 else "no checkpoint was saved before it")
        skips = self.run.train.nonfinite_skips
        when = (f"at step {first_bad}" if not skips else
                f"at step {first_bad} and stayed so through step {self.step}, more steps in a row than "
                f"train.nonfinite_skips={skips} lets skip")
        fix = ("let up to N bad steps be skipped with --set train.nonfinite_skips=N" if not skips else
               "raise train.nonfinite_skips")
        message = (f"the loss or gradient norm became non-finite {when} (lr {lr_at(first_bad, self.run):.3g}); "
                   f"nothing from step {first_bad} on was saved and {where}. Lower --lr, check the data, or {fix}")
        self._finish(status=f"stopped: non-finite loss or gradient norm at step {first_bad}")
        raise safety.NonFiniteError(message)

    def _stop_signal(self, signum: int) -> None:
        name = safety.signal_name(signum)
        saved = self._last_good_checkpoint(self.step + 1) if self.run.train.ckpt_every else None
        self._finish(status=f"stopped by {name} at step {self.step}")
        raise safety.RunStopped(signum, f"stopped by {name} at step {self.step} of {self.run.train.steps}; " + (
            f"checkpoint {saved} saved: continue with --resume" if saved else "no checkpoint (--ckpt-every 0)"))

    def _log(self, loss, aux, grad_norm, lr, steps, rows, load, window_start: float, val_loss=None) -> None:
        # one all-reduce and one host read for everything logged: loss, aux, grad norm, routed rows and, when
        # there are MoE layers, the tokens per expert summed over layers (float64: counts stay exact)
        values = torch.stack([loss.double(), aux.double(), grad_norm.double(), rows.double()])
        if load is not None:
            values = torch.cat([values, load.sum(0).double()])
        if dist.is_initialized():
            dist.all_reduce(values)
            values[:3] /= self.world
        loss_v, aux_v, gnorm_v, rows_v, *load_v = values.tolist()  # the one host sync of a logging step
        # the clock is read after that sync: the window's GPU work has finished, none of it spills uncounted
        # into the next window (no other host sync in a step lets the host run ahead by up to the launch queue)
        seconds = time.perf_counter() - window_start
        t = self.run.train
        sequences = steps * t.global_batch_size
        tokens = sequences * t.seq_len
        # rows were counted on each rank for its own tokens; their sum is the global routed rows
        flops = metrics.train_flops(self.flop_dims, sequences, routed_rows=int(rows_v) if load is not None else None)
        per_device = flops / seconds / self.world
        record = dict(loss=loss_v, aux_loss=aux_v, lr=lr, grad_norm=gnorm_v,
                      tokens_per_s=tokens / seconds, tflops=per_device / 1e12,
                      paper_tflops=metrics.paper_train_flops(self.flop_dims, sequences) / seconds / self.world / 1e12,
                      mfu=metrics.mfu(per_device, self.device) if self.device.type == "cuda" else None,
                      mem_bytes=metrics.peak_memory_bytes(self.device))
        record.update(self._comm_metrics(steps))
        if load is not None:
            record["imbalance"] = metrics.load_imbalance(torch.tensor(load_v))
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.logger.log(self.step, **record)

    def _comm_metrics(self, steps: int) -> dict[str, float]:
        """This rank's dispatch traffic per step since the last log (dispatchers count with no extra sync):
        MB sent over the network by the all-to-all dispatchers; for RBD also the inter-node rows against what
        flat all-to-all would have sent, and the redundancy rate R."""
        totals: dict[str, float] = {}
        for layer in self.model.moe_layers():
            stats = getattr(layer.dispatcher, "stats", None)
            if stats is None:
                continue
            for key, value in stats.as_dict().items():
                totals[key] = totals.get(key, 0) + value
            stats.reset()
        if not totals:
            return {}
        sent = totals.get("bytes_sent", totals.get("bytes_intra", 0) + totals.get("bytes_inter", 0))
        out = {"comm_mb_per_step": sent / steps / 2**20}
        if "rows_inter" in totals:
            slots = totals["slots"]
            out.update(rbd_inter_rows=totals["rows_inter"] / steps,
                       flat_inter_rows=totals["flat_rows_inter"] / steps,
                       rbd_redundancy=1.0 - totals["token_nodes"] / slots if slots else 0.0)
        return out

    def _announce(self, accum: int) -> None:
        t, m = self.run.train, self.run.model
        n_params = self.model.num_params()
        lines = [
            f"xmoe train: {n_params / 1e6:.2f}M parameters, {m.num_layers} layers "
            f"({m.num_layers - m.first_k_dense} MoE: {m.moe.num_experts} experts, top-{m.moe.top_k}, "
            f"{m.moe.num_shared_experts} shared), device {self.device}, {self.world} process(es)",
            f"data {self.data_spec}: vocab {self.dataset.vocab_size}, seq {t.seq_len}, global batch "
            f"{t.global_batch_size} ({self.micro_batch} x {accum} micro-batches x {self.dp_size} ranks), "
            f"compiled regions {'on' if self.compiled else 'off'}, recompute {t.recompute}",
            self.kernels.describe(),
        ]
        floor = getattr(self.dataset, "loss_floor", None)
        if floor is not None:
            lines.append(f"loss floor (source entropy at this seq_len) {floor:.3f} nats/token, unigram baseline "
                         f"{self.dataset.unigram_entropy:.3f}")
        if self.step:
            lines.append(f"continuing from step {self.step} to {t.steps}")
        lines.append(f"writing to {self.out_dir}/ (Ctrl-C or SIGTERM: save a checkpoint and stop)")
        log.info("\n".join(lines))
