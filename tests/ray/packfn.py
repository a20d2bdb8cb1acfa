"""A small real trainer with ``plora.engine.run_pack``'s signature, for the runtime's Ray tests.

Each config fits a 4-dim linear regression with SGD at its own lr and seed, one step per packed
step; it streams metrics, obeys control (stop / add / abort), checkpoints every N steps and
resumes from its checkpoint. Steps sleep ``PACKFN_STEP_S`` seconds so tests can time kills.
A pack with more than two configs whose ids start with ``oom`` raises ``torch.OutOfMemoryError``.
It exercises every runtime path without the cost of the LLM engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from plora.utils import atomic_write_json


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 4, generator=g)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])
    return x, x @ w


def run_pack(*, model, configs, dataset, out_dir, device=None, checkpoint_dir=None,
             checkpoint_every=None, resume=True, hooks=None):  # fmt: skip
    step_s = float(os.environ.get("PACKFN_STEP_S", "0.02"))
    if sum(c.config_id.startswith("oom") for c in configs) > 2:  # a pack too big for the GPU
        raise torch.OutOfMemoryError("CUDA out of memory (packfn: more than 2 'oom' configs)")
    x, y = _data(0)
    state: dict[str, dict] = {}
    ckpt = Path(checkpoint_dir) / "state.json" if checkpoint_dir else None
    if resume and ckpt is not None and ckpt.is_file():
        state = json.loads(ckpt.read_text())
    cfgs = {c.config_id: c for c in configs}
    for c in configs:
        if c.config_id not in state:
            w = torch.randn(4, generator=torch.Generator().manual_seed(c.seed)).tolist()
            state[c.config_id] = {"step": 0, "w": w, "loss": None, "status": "running"}
    steps = []
    n = 0
    while any(s["status"] == "running" for s in state.values()):
        n += 1
        t = time.perf_counter()
        time.sleep(step_s)
        metrics = []
        for cid, s in state.items():
            if s["status"] != "running":
                continue
            c = cfgs[cid]
            w = torch.tensor(s["w"], requires_grad=True)
            loss = ((x @ w - y) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                w -= c.lr * 100 * w.grad
            s.update(w=w.detach().tolist(), step=s["step"] + 1, loss=float(loss))
            if s["step"] >= c.max_steps:
                s["status"] = "done"
            metrics.append({"config_id": cid, "step": s["step"], "loss": float(loss), "lr": c.lr,
                            "tokens": 64, "grad_norm": 0.0, "time_s": step_s})  # fmt: skip
        dt = time.perf_counter() - t
        steps.append(
            SimpleNamespace(time_s=dt, seq_len=16, peak_memory_bytes=0, adapters=len(metrics))
        )
        if hooks is not None:
            hooks.on_metrics(metrics)
        if ckpt is not None and checkpoint_every and n % checkpoint_every == 0:
            atomic_write_json(ckpt, state)
        if hooks is not None:
            ctl = hooks.poll()
            if ctl.abort:
                raise RuntimeError("aborted")
            for cid in ctl.stop:
                if state.get(cid, {}).get("status") == "running":
                    state[cid]["status"] = "stopped"
            for c in ctl.add:
                cfgs[c.config_id] = c
                w = torch.randn(4, generator=torch.Generator().manual_seed(c.seed)).tolist()
                state[c.config_id] = {"step": 0, "w": w, "loss": None, "status": "running"}
    results = {}
    for cid, s in state.items():
        path = Path(out_dir) / cid
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path / "adapter.json", {"w": s["w"]})
        err = float(((x @ torch.tensor(s["w"]) - y) ** 2).mean())
        results[cid] = {"config_id": cid, "status": s["status"], "steps": s["step"], "tokens": 64 * s["step"],
                        "final_train_loss": s["loss"], "eval_loss": err, "eval_metric": -err,
                        "adapter_path": str(path)}  # fmt: skip
    profile = SimpleNamespace(device="cpu", steps=steps[:12], mean_step_time_s=step_s)
    return SimpleNamespace(results=results, profile=profile)
