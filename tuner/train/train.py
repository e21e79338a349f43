"""Train the tuner model from tuning records and ship it: `python -m tuner.train` (what `make model` runs).

data (collector JSONL and/or results DB / JSONL records) -> cases -> top configs per case weighted by relative
speed -> sentencepiece BPE -> tiny LLaMA (torch, CPU) -> GGUF f16 (gguf) -> Q8_0 (llama.cpp's quantizer)
-> agreement check torch vs llama.cpp -> held-out evaluation with the real proposer -> model card JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from kernels.registry import all_specs
from kernels.space import config_key, table_predicate
from tuner.model.inference import MODEL_NAME, PROMPT_FORMAT
from tuner.model.prompt import HISTORY_MAX, completion_text, prompt_text
from tuner.train import FOCUS_SHARE, check_focus_share
from tuner.train import data as D
from tuner.train.data import HwView as _HwView
from tuner.train.gguf_export import quantize_q8_0, write_f16
from tuner.train.model import Config, TinyLlama
from tuner.train.scorer import fit as fit_scorer
from tuner.train.scorer import summary as scorer_summary
from tuner.train.tokenizer import load as load_sp
from tuner.train.tokenizer import train_tokenizer

OUT_DIR = Path(__file__).resolve().parents[2] / "quantized_models"
HELDOUT_PROTOCOL = ("top-k restricted to each held-out case's measured reference table (as the bench replay), so a "
                    "proposal the collector never measured cannot count; `python bench/compare_tuners.py "
                    "--measure-topk 5` measures the unrestricted proposals for real")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The shipped model's architecture and training settings, in one place for `make model` and `edgetune train`.

    A small model (dim 192, 2 layers) keeps a proposal within milliseconds on an edge CPU; the settings are the
    best measured on the held-out cases, where a trial has to beat them across several seeds and runs, since one
    model's score moves by up to 15 of 72 cases from run to run. The trials, with their figures, are in
    quantized_models/data/recipe-trials.md."""

    dim: int = 192
    layers: int = 2
    heads: int = 3
    ffn: int = 512
    vocab: int = 768
    steps: int = 1200  # ~2.2 passes over the cases' examples (8,910); the loss still fell at 800 on the swept data
    #                    (quantized_models/data/recipe-trials.md: steps)
    batch: int = 16  # cases per step
    lr: float = 2e-3
    top: int = 10  # configs per case in the target
    tau: float = 0.08  # weight temperature over relative speed
    seed: int = 0
    threads: int = 2
    hw_mix: float = 0.5  # share of training prompts whose unvaried descriptor fields are redrawn (hw_variants)
    histories: int = 6  # measured histories drawn per training case (data.sample_history)
    hist_mix: float = 0.5  # share of training prompts that carry one (the session's later proposals do)
    focus_share: float = FOCUS_SHARE  # share of training draws given to the focus records' cases (`focus_repeats`)


# Edge devices' descriptor values, for the fields the collection machine never varied (a sample of plausible
# boards: Cortex-A53/A72/A76 SoCs, Atom/Celeron and Xeon/EPYC gateways).
EDGE_L1D = (16 << 10, 32 << 10, 48 << 10, 64 << 10)
EDGE_L2 = (128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)
EDGE_L3 = (None, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 300 << 20)
EDGE_CORES = (1, 2, 4, 8)
EDGE_BANDWIDTH_GBPS = (None, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
HW_VARIANTS = 4  # redrawn descriptors per training case


def hw_variants(hw: dict, rng: random.Random, n: int = HW_VARIANTS) -> list[dict]:
    """`n` copies of a case's descriptor with cache sizes, cores and bandwidth redrawn from EDGE_*; ISA and vector
    width stay, since the data varies them.

    The collector's journal comes from one machine, so those fields are one constant per ISA in its prompts: a model
    trained on them alone reads any other device's values (or a bandwidth not yet measured) as tokens it never
    saw, and its proposals shift at random. Measured on the 72 held-out cases, prompted with an AMD EPYC host's
    descriptor instead of the collection host's: without redrawing, the top-1 stayed in 34 and the whole top-5 in
    6; with it (hw_mix 0.5), in 67 and 38. Trained with the same labels under redrawn values, the model learns
    that the data says nothing about them; device records (`edgetune train --records`, the committed
    records.*.jsonl.gz) bring real other descriptors, and their cases are redrawn alike."""
    return [hw | {"l1d": rng.choice(EDGE_L1D), "l2": rng.choice(EDGE_L2), "l3": rng.choice(EDGE_L3),
                  "cores": rng.choice(EDGE_CORES), "bandwidth_gbps": rng.choice(EDGE_BANDWIDTH_GBPS)}
            for _ in range(n)]


def focus_repeats(n_focus: int, n_other: int, share: float) -> int:
    """How often each focus case enters a pass over the cases, so that the focus cases make up about `share` of the
    draws (never fewer than once).

    The focus records are the devices a model is built for (`edgetune train --records`, `fleet model build`): a
    fleet class's few dozen sessions beside ~900 committed cases would otherwise be 2-5% of the draws, too few to
    move the model on that class (quantized_models/data/recipe-trials.md: focus)."""
    if not n_focus or not n_other or share <= 0:
        return 1
    return max(1, round(share * n_other / ((1 - share) * n_focus)))


def redrawn_descriptors(cases: list[D.Case], recipe: Recipe) -> dict[int, list[dict]]:
    """`hw_variants` of every case but the focus ones (seeded): a focus case's descriptor is a real device's, and
    what it implies for the timings is what the model is built to learn."""
    rng = random.Random(recipe.seed)
    return {id(c): hw_variants(c.hw, rng) for c in cases if not c.focus} if recipe.hw_mix > 0 else {}


def spaces_meta(kernels: Iterable[str] | None = None) -> dict:
    """The knob spaces a model was trained for, by kernel: the strategy refuses a model for a kernel it lacks or
    whose knobs changed since (tuner.strategies.llm), so name only kernels the training data covered."""
    keep = set(all_specs()) if kernels is None else set(kernels)
    return {n: {p.name: [str(v) for v in p.values] for p in s.params} for n, s in all_specs().items() if n in keep}


def draw_histories(train: list[D.Case], n: int, seed: int) -> dict[int, list[list[tuple[dict, float]]]]:
    """`n` measured histories per training case, 1 to HISTORY_MAX configs each (seeded)."""
    rng = random.Random(f"histories-{seed}")
    return {id(c): [D.sample_history(c, rng, rng.randint(1, HISTORY_MAX)) for _ in range(n)] for c in train}


def build_corpus(train: list[D.Case], held: list[D.Case], variants: dict[int, list[dict]],
                 histories: dict[int, list] | None = None) -> list[str]:
    """Tokenizer corpus: every prompt, under its case's own and redrawn descriptors (held-out prompts only carry
    shape text, no config ranking), with its histories, + completions."""
    lines = []
    specs = all_specs()
    for c in train + held:
        for hw in [c.hw] + variants.get(id(c), []):
            lines.append(prompt_text(c.kernel, c.shape, hw))
        names = [p.name for p in specs[c.kernel].params]
        for h in (histories or {}).get(id(c), []):
            lines.append(prompt_text(c.kernel, c.shape, c.hw, h, names))
    for c in train:
        names = [p.name for p in specs[c.kernel].params]
        for cfg, _ in c.ranked()[:24]:
            lines.append(completion_text(cfg, names))
    for n, s in specs.items():  # every value of every knob, at least once
        lines.append("".join(f" {p.name}={v}" for p in s.params for v in p.values))
    return lines


def encode_cases(sp, examples, variants: dict[int, list[dict]], histories: dict[int, list] | None = None,
                 recipe: "Recipe | None" = None) -> list[dict]:
    """One packed item per case: the prompt once, then each of its top configs as a branch that sees the prompt
    and itself only (positions restart after the prompt), with the configs' weights. `prompts` holds the prompt
    under the case's own descriptor first, then under each of its redrawn ones (`hw_variants`). `hist` holds the
    case under each of its measured histories: (prompts as above with the history appended, the branches of its
    top configs that the history has not measured)."""
    specs = all_specs()
    r = recipe or Recipe()
    by_case: dict[int, list] = {}
    cases = {}
    for case, cfg, w in examples:
        by_case.setdefault(id(case), []).append((cfg, w))
        cases[id(case)] = case
    items = []
    for cid, branches in by_case.items():
        case = cases[cid]
        names = [p.name for p in specs[case.kernel].params]

        def encoded(history: list, targets: list) -> tuple[list, list]:
            prompts = []
            for hw in [case.hw] + variants.get(cid, []):
                text = prompt_text(case.kernel, case.shape, hw, history, names)
                prompt = [sp.bos_id()] + sp.encode(text)
                full = sp.encode(text + completion_text(targets[0][0], names))
                assert full[:len(prompt) - 1] == prompt[1:], "prompt/completion tokenisation is not context-free"
                prompts.append(prompt)
            return prompts, [(sp.encode(completion_text(cfg, names)) + [sp.eos_id()], w) for cfg, w in targets]

        prompts, encoded_branches = encoded([], branches)
        hist = []
        for h in (histories or {}).get(cid, []):
            left = D.targets(case, r.top, r.tau, {config_key(c) for c, _ in h})
            if left:
                hist.append(encoded(h, left))
        items.append({"prompts": prompts, "branches": encoded_branches, "hist": hist, "focus": case.focus})
    return items


def pack(items: list[dict]) -> tuple[torch.Tensor, ...]:
    """Batch of packed cases, each item with the one `prompt` it is trained under this step -> ids, pos, mask,
    (src index, target, weight) for the loss."""
    lens = [len(it["prompt"]) + sum(len(b) - 1 for b, _ in it["branches"]) for it in items]
    T = max(lens)
    B = len(items)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
    src, tgt, wts = [], [], []
    for r, it in enumerate(items):
        P = it["prompt"]
        p = len(P)
        ids[r, :p] = torch.tensor(P)
        pos[r, :p] = torch.arange(p)
        mask[r, 0, :p, :p] = torch.tril(torch.ones(p, p, dtype=torch.bool))
        o = p
        for toks, w in it["branches"]:
            body = toks[:-1]  # the last token (EOS) is only a target
            n = len(body)
            ids[r, o:o + n] = torch.tensor(body)
            pos[r, o:o + n] = torch.arange(p, p + n)
            mask[r, 0, o:o + n, :p] = True
            mask[r, 0, o:o + n, o:o + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            srcs = [r * T + p - 1] + [r * T + o + j for j in range(n)]
            src += srcs
            tgt += toks
            wts += [w] * len(toks)
            o += n
        for j in range(o, T):  # padding attends to itself only (keeps softmax finite)
            mask[r, 0, j, j] = True
    return ids, pos, mask, torch.tensor(src), torch.tensor(tgt), torch.tensor(wts, dtype=torch.float32)


def train_model(items: list[dict], cfg: Config, *, steps: int, batch: int, lr: float, seed: int, hw_mix: float = 0.0,
                hist_mix: float = 0.0, focus_share: float = 0.0, log_every: int = 25, deadline_s: float | None = None
                ) -> tuple[TinyLlama, list[float]]:
    """AdamW over shuffled batches of cases, the focus cases repeated in each pass (`focus_repeats`); each case is
    trained under one of its measured histories with probability `hist_mix` (else with none), and under one of its
    redrawn descriptors with probability `hw_mix`, else under its own."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = TinyLlama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    n_focus = sum(1 for it in items if it.get("focus"))
    reps = focus_repeats(n_focus, len(items) - n_focus, focus_share)
    order = [i for i, it in enumerate(items) for _ in range(reps if it.get("focus") else 1)]
    n = len(order)
    losses = []
    t0 = time.time()
    pos_i = n
    for step in range(steps):
        if deadline_s and time.time() - t0 > deadline_s and step > 0:
            print(f"  stopping at step {step}: time budget reached", flush=True)
            break
        # cosine decay over whichever runs out first, the steps or the time budget (a busy machine still anneals)
        prog = max(step / steps, (time.time() - t0) / deadline_s if deadline_s else 0.0)
        lr_now = lr * min(1.0, (step + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
        for g in opt.param_groups:
            g["lr"] = lr_now
        if pos_i + batch > n:
            rng.shuffle(order)
            pos_i = 0
        idx = order[pos_i:pos_i + batch]
        pos_i += batch
        batch_items = []
        for i in idx:
            ps, branches = items[i]["prompts"], items[i]["branches"]
            if items[i].get("hist") and rng.random() < hist_mix:
                ps, branches = rng.choice(items[i]["hist"])
            p = rng.choice(ps[1:]) if len(ps) > 1 and rng.random() < hw_mix else ps[0]
            batch_items.append({"prompt": p, "branches": branches})
        ids, pos, mask, src, tgt, w = pack(batch_items)
        logits = model(ids, pos, mask).reshape(-1, cfg.vocab)[src]
        nll = F.cross_entropy(logits, tgt, reduction="none")
        loss = (nll * w).sum() / len(idx)  # weights sum to 1 per case: the mean over cases of E_w[-log p]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"  step {step:5d} loss {np.mean(losses[-log_every:]):.4f} lr {lr_now:.2e} "
                  f"{time.time() - t0:.0f}s load {os.getloadavg()[0]:.2f}", flush=True)
    return model, losses


def agreement(model: TinyLlama, gguf_path: Path, seqs: list[list[int]]) -> dict:
    """Max |torch - llama.cpp| logits and top-1 agreement over a few sequences."""
    from tuner.model.inference import LlamaModel

    lm = LlamaModel(gguf_path, n_seq_max=4)
    diffs, agree, total = [], 0, 0
    model.eval()
    with torch.no_grad():
        for s in seqs:
            a = model(torch.tensor([s]))[0].numpy()
            b = lm.logits(s)
            diffs.append(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-9)))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(s)
    lm.close()
    return {"max_rel_diff": max(diffs), "top1_agree": agree / total}


def evaluate_heldout(gguf_path: Path, held: list[D.Case], k: int = 5) -> dict:
    """Propose top-k on each held-out case (restricted to its measured table, as in the bench replay)."""
    from tuner.model.proposer import Proposer

    specs = all_specs()
    prop = Proposer(path=gguf_path)
    rows, lat = [], []
    for c in held:
        spec = specs[c.kernel]
        hw = _HwView(c.hw)
        space = spec.space(c.shape, hw)
        table = c.table()
        pred = table_predicate(space.names, [c.configs[key] for key in table])
        res = prop.propose(c.kernel, space, k, extra=pred)
        lat.append(res.latency_ms)
        best = min(table.values())
        got = [table[config_key(p.config)] for p in res.proposals if config_key(p.config) in table]
        evals_to = next((i + 1 for i, ms in enumerate(got) if ms <= best * 1.05), None)
        rows.append({"kernel": c.kernel, "isa": c.isa, "workload": c.workload, "best_ms": best,
                     "top1_ratio": got[0] / best if got else None, "topk_ratio": min(got) / best if got else None,
                     "evals_to_5pct": evals_to})
    prop.m.close()
    n = len(rows)
    return {
        "cases": n, "k": k,
        "top1_within_5pct": sum(1 for r in rows if r["top1_ratio"] and r["top1_ratio"] <= 1.05) / n,
        "topk_within_5pct": sum(1 for r in rows if r["topk_ratio"] and r["topk_ratio"] <= 1.05) / n,
        "median_topk_ratio": float(np.median([r["topk_ratio"] or 9 for r in rows])),
        "median_evals_to_5pct": float(np.median([r["evals_to_5pct"] or 99 for r in rows])),
        "latency_ms_p50": float(np.percentile(lat, 50)), "latency_ms_p95": float(np.percentile(lat, 95)),
        "per_case": rows,
    }


def run(data: list[Path], records: list[Path], out_dir: Path, recipe: Recipe = Recipe(), *,
        deadline_s: float | None, name: str = MODEL_NAME, focus: Iterable[Path] = ()) -> dict:
    """Train and ship a model from `data` (collector journals) and `records`; the cases that the `focus` records
    (some of `records`) measure get `recipe.focus_share` of the draws and keep their own descriptor: they are the
    devices the model is for, and their descriptor is what tells the model that their timings differ."""
    t_all = time.time()
    r = recipe
    check_focus_share(r.focus_share, "focus_share")
    torch.set_num_threads(r.threads)
    cases, dataset_sha, n_sessions, measured, from_journal = D.load_cases(data, records, frozenset(focus))
    train, held = D.split_cases(cases)
    if not train:
        raise SystemExit("no training cases in the data")
    examples = D.training_examples(train, top=r.top, tau=r.tau)
    n_focus = sum(c.focus for c in train)
    print(f"cases: {len(train)} train ({n_focus} focus, each drawn "
          f"{focus_repeats(n_focus, len(train) - n_focus, r.focus_share)}x), {len(held)} held-out; {len(examples)} "
          f"weighted examples; {n_sessions} record sessions ({measured} measurements; "
          f"{len(cases) - from_journal} new cases)", flush=True)
    variants = redrawn_descriptors(train + held, r)
    histories = draw_histories(train, r.histories, r.seed) if r.hist_mix > 0 else {}
    proto = train_tokenizer(build_corpus(train, held, variants, histories), r.vocab)
    sp = load_sp(proto)
    items = encode_cases(sp, examples, variants, histories, r)
    seqs = [it["prompts"][0] + b[0] for it in items for b in it["branches"][:1]]
    hist_seqs = [it["hist"][0][0][0] + it["hist"][0][1][0][0] for it in items[:: max(1, len(items) // 2)] if it["hist"]]
    longest = max(max(map(len, ps)) + max(len(b) for b, _ in bs)
                  for it in items for ps, bs in [(it["prompts"], it["branches"])] + it["hist"])
    cfg = Config(vocab=sp.get_piece_size(), dim=r.dim, layers=r.layers, heads=r.heads, ffn=r.ffn,
                 ctx=max(128, 2 ** math.ceil(math.log2(longest + 8))))
    print(f"tokenizer: {cfg.vocab} pieces; longest sequence {longest} tokens; model {cfg}", flush=True)
    model, losses = train_model(items, cfg, steps=r.steps, batch=r.batch, lr=r.lr, seed=r.seed, hw_mix=r.hw_mix,
                                hist_mix=r.hist_mix, focus_share=r.focus_share, deadline_s=deadline_s)
    version = f"{time.strftime('%Y%m%d')}-{dataset_sha[:8]}-{hashlib.sha256(json.dumps(cfg.to_dict()).encode()).hexdigest()[:6]}"
    training = {"steps": len(losses), "batch": r.batch, "lr": r.lr, "top": r.top, "tau": r.tau, "seed": r.seed,
                "hw_mix": r.hw_mix, "hw_variants": HW_VARIANTS if r.hw_mix > 0 else 0, "histories": r.histories,
                "hist_mix": r.hist_mix, "focus_share": r.focus_share,
                "final_loss": float(np.mean(losses[-50:])), "threads": r.threads, "arch": cfg.to_dict()}
    scorer = fit_scorer(train)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        f16 = Path(td) / f"{name}.f16.gguf"
        q8 = Path(td) / f"{name}.Q8_0.gguf"
        meta = {"name": name, "version": version, "dataset_sha256": dataset_sha, "prompt_format": PROMPT_FORMAT,
                "training": training}
        write_f16(model, proto, f16, meta | {"spaces": spaces_meta({c.kernel for c in train}), "scorer": scorer})
        quantize_q8_0(f16, q8, r.threads)
        probe_seqs = seqs[:: max(1, len(seqs) // 4)][:4] + hist_seqs[:2]  # with and without a history
        agree_f16 = agreement(model, f16, probe_seqs)
        agree_q8 = agreement(model, q8, probe_seqs)
        print(f"torch vs llama.cpp: f16 {agree_f16}, Q8_0 {agree_q8}", flush=True)
        final = out_dir / f"{name}.Q8_0.gguf"
        shutil.copyfile(q8, final)
        (out_dir / f"{name}.tokenizer.model").write_bytes(proto)
    metrics = evaluate_heldout(final, held) if held else {}
    card = {
        "name": name, "version": version, "file": final.name, "bytes": final.stat().st_size,
        "sha256": hashlib.sha256(final.read_bytes()).hexdigest(), "quantization": "Q8_0 (llama_model_quantize)",
        "architecture": "llama", "prompt_format": PROMPT_FORMAT, "dataset_sha256": dataset_sha,
        "dataset_sha256_covers": "sha256 over the kind=hw and split=train lines of the data files (each as JSON with "
                                 "sorted keys, in file order), then the bytes of any --records files",
        "dataset_files": [os.path.relpath(p, OUT_DIR.parent) if Path(p).resolve().is_relative_to(OUT_DIR.parent)
                          else str(p) for p in data + records],
        "cases": {"train": len(train), "focus": n_focus, "heldout": len(held), "examples": len(examples)},
        "tokenizer": {"type": "sentencepiece BPE", "pieces": cfg.vocab, "add_space_prefix": False},
        "training": training, "training_seconds": round(time.time() - t_all, 1),
        "agreement": {"f16": agree_f16, "q8_0": agree_q8},
        "scorer": scorer_summary(scorer),
        "heldout_protocol": HELDOUT_PROTOCOL,
        "heldout": {k: v for k, v in metrics.items() if k != "per_case"},
        "heldout_per_case": metrics.get("per_case", []),
    }
    (out_dir / f"{name}.card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["heldout"], indent=2), flush=True)
    print(f"wrote {final} ({card['bytes']} bytes) and its card in {time.time() - t_all:.0f}s", flush=True)
    return card


def refresh_card(out_dir: Path, data: list[Path], name: str = MODEL_NAME) -> dict:
    """Recompute a shipped model's held-out metrics on (possibly grown) reference tables; rewrite its card."""
    card_path = out_dir / f"{name}.card.json"
    card = json.loads(card_path.read_text())
    cases: dict = {}
    for p in data:
        D.load_collector(p, cases)
    _, held = D.split_cases(cases)
    metrics = evaluate_heldout(out_dir / card["file"], held)
    card["heldout"] = {k: v for k, v in metrics.items() if k != "per_case"}
    card["heldout_per_case"] = metrics["per_case"]
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["heldout"], indent=2))
    return card


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", action="append", help=f"collector JSONL(.gz) (default: {D.DEFAULT_DATA})")
    ap.add_argument("--records", action="append", default=[], help="results DB or JSONL records of the devices the model is for: "
                                                                    "their cases get --focus_share of the draws")
    ap.add_argument("--no-base", action="store_true",
                    help="train on --records only (not the committed journal and device records)")
    ap.add_argument("--out", default=str(OUT_DIR))
    for f in dataclasses.fields(Recipe):
        ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    ap.add_argument("--max-minutes", type=float, default=30.0,
                    help="safety net: stop training after this long (the card records the steps done)")
    ap.add_argument("--card-only", action="store_true", help="only re-evaluate the held-out metrics of --out's model")


def cmd_train(a: argparse.Namespace) -> int:
    data, records = D.base_sources(a.data, a.no_base)
    if a.card_only:
        refresh_card(Path(a.out), data)
        return 0
    recipe = Recipe(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Recipe)})
    mine = [Path(p) for p in a.records]
    run(data, records + mine, Path(a.out), recipe, deadline_s=a.max_minutes * 60, focus=mine)
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python -m tuner.train", __doc__.split("\n\n")[0], add_arguments, cmd_train, argv)


if __name__ == "__main__":
    sys.exit(main())
