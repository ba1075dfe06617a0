"""The standing model-zoo check (issue 31): autopar on model code this project
did not write. Hugging Face transformers architectures (tiny configs, random
weights, nothing downloaded: the 23 of tests/fixtures/hf.py and more), and
models of other code bases that import here without torchvision
(x-transformers, perceiver-pytorch, mlp-mixer-pytorch: `pip install -e
'.[zoo]'`; a code base that is not installed gives rows that say so).

For each model and mesh (4 and 2x2 by default) it records the compile time,
the ops without a sharding rule (they run replicated), the fraction of the
parameters (by elements) that the solved plan splits, and whether training
under a plan agrees with one device (autopar.verify.check: loss, every
gradient, the parameters after 2 AdamW steps) on 4 gloo ranks, for two plans:
the solved plan and a *sharding plan*, a random valid plan (every node a
random strategy, autopar.verify.random_plan) whose seed is the first that
splits at least ``--min-sharded`` of the parameters' elements. Solved plans
for models this small keep most parameters whole (issue 31, item 3); the
sharding plans are what make the check test split parameters.

    python benchmarks/model_zoo.py                       # every model, print the table
    python benchmarks/model_zoo.py --write docs/coverage.md
    python benchmarks/model_zoo.py --models hf_vit,xt_decoder --meshes 4

Plans are made in this process; the checks run under torchrun, many models
per launch (``--group``), each rank calling autopar.verify.check on the saved
plans. A check that hangs or kills its launch is ended by a watchdog
(``--job-timeout``) and recorded with what the launch printed; the launch
goes on with the remaining checks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.relpath(os.path.abspath(__file__), ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))


# --------------------------------------------------------------------------
# The models. Factories return (model, example inputs, loss_fn), as
# `autopar verify FILE.py:FACTORY` takes them; dropout is off everywhere
# (verify compares with one device bit for bit).
# --------------------------------------------------------------------------

def _hf():
    import hf  # tests/fixtures/hf.py: its helpers build the library's models with tiny configs
    return hf


def hf_vit(batch: int = 8):
    h = _hf()
    import transformers as t
    return h._image_classifier(t.ViTConfig, t.ViTForImageClassification, batch, image_size=32, patch_size=8,
                               **{k: v for k, v in h.ENCODER.items() if k != "max_position_embeddings"})


def hf_beit(batch: int = 8):
    """Relative position biases, layer scale (stochastic depth off: its draws cannot match one device)."""
    h = _hf()
    import transformers as t
    return h._image_classifier(t.BeitConfig, t.BeitForImageClassification, batch, "eager", image_size=32,
                               patch_size=8, use_relative_position_bias=True, drop_path_rate=0.0,
                               **{k: v for k, v in h.ENCODER.items() if k != "max_position_embeddings"})


def hf_regnet(batch: int = 8):
    """Grouped convolutions, squeeze-and-excitation, batch norm."""
    h = _hf()
    import transformers as t
    return h._image_classifier(t.RegNetConfig, t.RegNetForImageClassification, batch, "eager", embedding_size=8,
                               hidden_sizes=[8, 16], depths=[1, 1], groups_width=4)


def hf_mobilenet_v2(batch: int = 8):
    """Depthwise convolutions, ReLU6, batch norm."""
    h = _hf()
    import transformers as t
    return h._image_classifier(t.MobileNetV2Config, t.MobileNetV2ForImageClassification, batch, "eager",
                               image_size=32, depth_multiplier=0.25, finegrained_output=False,
                               classifier_dropout_prob=0.0)


def hf_mistral(batch: int = 8):
    h = _hf()
    import transformers as t
    return h._causal_lm(t.MistralConfig, t.MistralForCausalLM, batch, **h.DECODER, sliding_window=8)


def hf_qwen3(batch: int = 8):
    """Query and key RMS norms."""
    h = _hf()
    import transformers as t
    return h._causal_lm(t.Qwen3Config, t.Qwen3ForCausalLM, batch, **h.DECODER, head_dim=8)


def hf_gpt_neo(batch: int = 8):
    """Local and global attention layers."""
    h = _hf()
    import transformers as t
    return h._causal_lm(t.GPTNeoConfig, t.GPTNeoForCausalLM, batch, "eager", hidden_size=32, num_layers=2,
                        num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
                        max_position_embeddings=64, embed_dropout=0.0, attention_dropout=0.0,
                        resid_dropout=0.0, bos_token_id=0, eos_token_id=0)


def hf_deepseek_v3(batch: int = 8):
    """Multi-head latent attention, routed and shared experts."""
    h = _hf()
    import transformers as t
    return h._causal_lm(t.DeepseekV3Config, t.DeepseekV3ForCausalLM, batch, hidden_size=32,
                        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, max_position_embeddings=64)


def hf_olmoe(batch: int = 8):
    h = _hf()
    import transformers as t
    return h._causal_lm(t.OlmoeConfig, t.OlmoeForCausalLM, batch, **h.DECODER, num_experts=4,
                        num_experts_per_tok=2, eos_token_id=0)


def hf_albert(batch: int = 8):
    """One layer's weights shared by every layer."""
    h = _hf()
    import transformers as t
    return h._classifier(t.AlbertConfig, t.AlbertForSequenceClassification, batch, embedding_size=16,
                         classifier_dropout_prob=0.0, **h.ENCODER)


def hf_bart(batch: int = 8):
    """Encoder-decoder, learned positions, tied embeddings."""
    h = _hf()
    import transformers as t
    torch.manual_seed(0)
    model = t.BartForConditionalGeneration(h._config(
        t.BartConfig, vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    src, dec = torch.randint(0, 128, (batch, 12)), torch.randint(0, 128, (batch, 10))
    return h.Logits(model, "input_ids", "decoder_input_ids"), (src, dec, dec), h.lm_loss


def hf_whisper(batch: int = 8):
    """Speech encoder-decoder: log-mel features (batch, 16 mels, 32 frames)
    through two convolutions, decoder tokens as targets."""
    h = _hf()
    import transformers as t
    torch.manual_seed(0)
    model = t.WhisperForConditionalGeneration(h._config(
        t.WhisperConfig, vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2))
    feats, dec = torch.randn(batch, 16, 32), torch.randint(0, 128, (batch, 10))
    return h.Logits(model, "input_features", "decoder_input_ids"), (feats, dec, dec), h.lm_loss


def hf_wav2vec2(batch: int = 8):
    """Raw audio (batch, 400 samples): a convolutional feature encoder with
    group norm, a convolutional position embedding, a transformer encoder,
    sequence classification."""
    h = _hf()
    import transformers as t
    torch.manual_seed(0)
    model = t.Wav2Vec2ForSequenceClassification(h._config(
        t.Wav2Vec2Config, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, num_labels=3, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
        classifier_proj_size=16))
    return h.Logits(model, "input_values"), (torch.randn(batch, 400), torch.randint(0, 3, (batch,))), \
        F.cross_entropy


def _xt():
    import x_transformers
    return x_transformers


class _Tokens(nn.Module):
    """A model whose one input is token ids and whose output is logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)


def _lm(model, batch: int, vocab: int = 128, seq: int = 16):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq))
    return _Tokens(model), (ids, ids), _hf().lm_loss


def xt_decoder(batch: int = 8):
    """x-transformers: a decoder LM with rotary positions, RMS norm and a GLU feed-forward."""
    xt = _xt()
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=128, max_seq_len=64, use_abs_pos_emb=False, attn_layers=xt.Decoder(
        dim=32, depth=2, heads=4, rotary_pos_emb=True, use_rmsnorm=True, ff_glu=True))
    return _lm(model, batch)


def xt_encoder(batch: int = 8):
    """x-transformers: an encoder with ALiBi biases, pre-norm residuals scaled (ReZero-free), a mean pool."""
    xt = _xt()
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=128, max_seq_len=64, use_abs_pos_emb=False, logits_dim=3,
                                  average_pool_embed=True, attn_layers=xt.Encoder(
                                      dim=32, depth=2, heads=4, alibi_pos_bias=True, alibi_num_heads=2))
    torch.manual_seed(1)
    return _Tokens(model), (torch.randint(0, 128, (batch, 16)), torch.randint(0, 3, (batch,))), F.cross_entropy


def xt_encdec(batch: int = 8):
    """x-transformers: an encoder-decoder (XTransformer) that returns its own
    autoregressive loss over the shifted targets."""
    xt = _xt()
    torch.manual_seed(0)
    model = xt.XTransformer(dim=32, enc_num_tokens=128, enc_depth=2, enc_heads=4, enc_max_seq_len=32,
                            dec_num_tokens=128, dec_depth=2, dec_heads=4, dec_max_seq_len=32, tie_token_emb=True)
    torch.manual_seed(1)
    return model, (torch.randint(0, 128, (batch, 12)), torch.randint(1, 128, (batch, 11))), None


def xt_vit(batch: int = 8):
    """x-transformers: a vision transformer (ViTransformerWrapper)."""
    xt = _xt()
    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(image_size=32, patch_size=8, num_classes=5,
                                    attn_layers=xt.Encoder(dim=32, depth=2, heads=4))
    torch.manual_seed(1)
    return model, (torch.randn(batch, 3, 32, 32), torch.randint(0, 5, (batch,))), F.cross_entropy


def perceiver(batch: int = 8):
    """perceiver-pytorch: Perceiver on images (batch, 16, 16, 3), Fourier
    features of the pixel positions, latents cross-attending to the pixels."""
    from perceiver_pytorch import Perceiver
    torch.manual_seed(0)
    model = Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=8.0, depth=2, num_latents=16,
                      latent_dim=32, cross_heads=1, latent_heads=4, cross_dim_head=8, latent_dim_head=8,
                      num_classes=5)
    torch.manual_seed(1)
    return model, (torch.randn(batch, 16, 16, 3), torch.randint(0, 5, (batch,))), F.cross_entropy


def perceiver_lm(batch: int = 8):
    """perceiver-pytorch: PerceiverLM (Perceiver IO), token and position
    embeddings, queries decoding every position."""
    from perceiver_pytorch import PerceiverLM
    torch.manual_seed(0)
    model = PerceiverLM(num_tokens=128, dim=32, depth=2, max_seq_len=16, num_latents=8, latent_dim=32,
                        cross_heads=1, latent_heads=4, cross_dim_head=8, latent_dim_head=8)
    return _lm(model, batch)


def mlp_mixer(batch: int = 8):
    """mlp-mixer-pytorch: MLP-Mixer, token mixing by 1x1 convolutions over patches."""
    from mlp_mixer_pytorch import MLPMixer
    torch.manual_seed(0)
    model = MLPMixer(image_size=32, channels=3, patch_size=8, dim=32, depth=2, num_classes=5)
    torch.manual_seed(1)
    return model, (torch.randn(batch, 3, 32, 32), torch.randint(0, 5, (batch,))), F.cross_entropy


def permutator(batch: int = 8):
    """mlp-mixer-pytorch: Vision Permutator, mixing along height, width and channels."""
    from mlp_mixer_pytorch import Permutator
    torch.manual_seed(0)
    model = Permutator(image_size=32, patch_size=8, dim=32, depth=2, num_classes=5, segments=4)
    torch.manual_seed(1)
    return model, (torch.randn(batch, 3, 32, 32), torch.randint(0, 5, (batch,))), F.cross_entropy


@dataclass(frozen=True)
class Entry:
    name: str
    code_base: str
    kind: str
    source: str  # FILE.py:FACTORY, relative to the repository root


def _fixture(name, kind):
    return Entry(f"hf_{name}", "transformers", kind, f"tests/fixtures/hf.py:{name}")


def _here(name, code_base, kind):
    return Entry(name, code_base, kind, f"{HERE}:{name}")


ZOO = [  # models new to this project first, then those of tests/fixtures/hf.py
    _here("xt_decoder", "x-transformers", "decoder LM"),
    _here("perceiver", "perceiver-pytorch", "vision"),
    _here("mlp_mixer", "mlp-mixer-pytorch", "vision"),
    _here("hf_vit", "transformers", "vision"),
    _here("hf_whisper", "transformers", "audio encoder-decoder"),
    _here("hf_deepseek_v3", "transformers", "MoE decoder LM"),
    _here("xt_encoder", "x-transformers", "encoder"),
    _here("perceiver_lm", "perceiver-pytorch", "decoder LM"),
    _here("permutator", "mlp-mixer-pytorch", "vision"),
    _here("hf_bart", "transformers", "encoder-decoder"),
    _here("hf_wav2vec2", "transformers", "audio"),
    _here("hf_olmoe", "transformers", "MoE decoder LM"),
    _here("xt_encdec", "x-transformers", "encoder-decoder"),
    _here("xt_vit", "x-transformers", "vision"),
    *(_here(n, "transformers", "decoder LM") for n in ("hf_mistral", "hf_qwen3", "hf_gpt_neo")),
    _here("hf_albert", "transformers", "encoder"),
    *(_here(n, "transformers", "vision") for n in ("hf_beit", "hf_regnet", "hf_mobilenet_v2")),
    *(_fixture(n, "vision") for n in ("resnet", "convnext", "swin", "deit")),
    _fixture("t5", "encoder-decoder"),
    *(_fixture(n, "MoE decoder LM") for n in ("mixtral", "qwen2_moe")),
    *(_fixture(n, "encoder") for n in ("bert", "roberta", "distilbert", "deberta", "electra")),
    *(_fixture(n, "decoder LM") for n in ("llama", "gpt2", "gemma", "gemma2", "phi3", "opt", "gpt_neox", "falcon",
                                           "bloom", "olmo", "stablelm")),
]


PLANS = ("solved", "random")

# --------------------------------------------------------------------------
# Plans (this process): compile time, coverage, the fraction sharded, and a
# sharding plan for every model and mesh.
# --------------------------------------------------------------------------

def sharded_fraction(plan) -> float:
    """The fraction of the parameters' elements that the plan splits over at
    least one mesh axis (a parameter Shard(d) on any axis)."""
    total = split = 0
    for p in plan.parameters.values():
        n = 1
        for s in p["shape"]:
            n *= s
        total += n
        split += n if any(x != "R" for x in p["placements"]) else 0
    return split / total if total else 0.0


def _error(e: BaseException) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def sharding_plan(source: str, mesh: str, cluster: str, min_sharded: float, seeds: int):
    """The first random valid plan (seeds 0, 1, ...) that splits at least
    ``min_sharded`` of the parameters, else the one that splits the most:
    (seed, fraction, plan); each drawn on a freshly built model."""
    from autopar.runtime import load_factory
    from autopar.verify import random_plan
    best = None
    for seed in range(seeds):
        plan = random_plan(*load_factory(source), mesh, cluster, seed)
        fraction = sharded_fraction(plan)
        if best is None or fraction > best[1]:
            best = (seed, fraction, plan)
        if fraction >= min_sharded:
            break
    return best


def plan_model(entry: Entry, meshes: list, cluster: str, min_sharded: float, seeds: int, work: str,
               plans: tuple = PLANS, time_limit_s: float = 10.0) -> dict:
    """Compile ``entry`` for every mesh (without recomputation, which models
    this small never need; the solver stopped after ``time_limit_s``) and draw
    its sharding plans; the plans are saved under ``work`` for the checks."""
    from autopar.compiler import compile as compile_plan
    from autopar.runtime import load_factory
    row = {"name": entry.name, "code_base": entry.code_base, "kind": entry.kind, "source": entry.source,
           "meshes": {}}
    try:
        model, inputs, loss_fn = load_factory(entry.source)
    except ImportError as e:
        row["error"] = f"not installed ({e.name}): pip install -e '.[zoo]'"
        return row
    except Exception as e:  # a model the library cannot build with this config is a finding too
        row["error"] = "building the model: " + _error(e)
        return row
    row["params"] = sum(p.numel() for p in model.parameters())
    for mesh in meshes:
        r = row["meshes"][mesh] = {}
        tag = f"{entry.name}.{mesh}"
        if "solved" in plans:
            start = time.perf_counter()
            try:
                # A fresh model for every trace, as each check builds one: a model may change itself in
                # its first forward (x-transformers' ALiBi registers its bias as a buffer), and a plan
                # fits the model it was traced from.
                model, inputs, loss_fn = load_factory(entry.source)
                plan = compile_plan(model, inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn,
                                    source=entry.source, time_limit_s=time_limit_s, recompute="none")
            except Exception as e:  # no solved plan; the sharding plan is still drawn and checked
                r["compile_error"] = _error(e)
            else:
                r["nodes"] = len(plan.nodes)
                r["fallbacks"] = sorted({f["op"] for f in plan.fallbacks})
                r["fallback_nodes"] = len(plan.fallbacks)
                r["solver"] = plan.solver.get("status")
                r["sharded"] = sharded_fraction(plan)
                r["solved_plan"] = os.path.join(work, f"{tag}.solved.json")
                plan.save(r["solved_plan"])
            r["compile_s"] = time.perf_counter() - start
        if "random" not in plans:
            continue
        try:
            seed, fraction, rplan = sharding_plan(entry.source, mesh, cluster, min_sharded, seeds)
        except Exception as e:
            r["random_error"] = _error(e)
            continue
        r["random_seed"], r["random_sharded"] = seed, fraction
        r["random_plan"] = os.path.join(work, f"{tag}.random{seed}.json")
        rplan.save(r["random_plan"])
    return row


# --------------------------------------------------------------------------
# Checks (under torchrun): every rank runs autopar.verify.check on each job.
# --------------------------------------------------------------------------

REPORTED = ("loss_rel", "grad", "param", "param_floor", "tol", "dtype", "rounding_only")


def rank_main(jobs_path: str, results_path: str, progress_path: str) -> None:
    """One launch's ranks: check each job's plan in turn; rank 0 writes a
    result line per job (and, before it, the job it starts, for the watchdog)."""
    from autopar.runtime import shutdown
    from autopar.verify import agrees, check
    with open(jobs_path) as f:
        jobs = json.load(f)
    rank = int(os.environ.get("RANK", "0"))
    for job in jobs:
        if rank == 0:
            with open(progress_path, "w") as f:
                f.write(job["key"])
        start = time.perf_counter()
        try:
            r = check(job["source"], job["mesh"], job["cluster"], steps=2, plan_path=job["plan"])
            out = {k: r[k] for k in REPORTED}
            out["agrees"] = agrees(r)
        except Exception as e:
            out = {"error": _error(e)}
            if rank == 0:
                traceback.print_exc()
        out["check_s"] = time.perf_counter() - start
        if rank == 0:
            with open(results_path, "a") as f:
                f.write(json.dumps({"key": job["key"], **out}) + "\n")
    shutdown(exit_code=0)


LOST_RANK = ("terminate called without an active exception", "Connection reset by peer")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_results(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["key"]: r for r in map(json.loads, f)}


def _last_error(log: str) -> str:
    """The exception line of the log's last traceback, else its last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if ("Error" in line or "Exception" in line) and ":" in line
              and not line.startswith(" ")]
    text = (errors or lines or ["(no output)"])[-1].strip()
    return text if len(text) <= 300 else text[:297] + "..."


def run_checks(jobs: list, work: str, group: int, job_timeout: float, nproc: int = 4) -> dict:
    """Run the jobs ``group`` at a time, each group in one torchrun launch.
    A job that runs past ``job_timeout`` or takes its launch down is recorded
    as failed (a launch that lost a rank process to the machine gets one more
    try) and the rest of its group goes on in the next launch."""
    results, pending, tries = {}, list(jobs), {}
    launch = sum(1 for f in os.listdir(work) if f.endswith(".jobs"))  # earlier calls' launches keep their files
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    while pending:
        batch, launch = pending[:group], launch + 1
        paths = {k: os.path.join(work, f"launch{launch}.{k}") for k in ("jobs", "results", "progress", "log")}
        with open(paths["jobs"], "w") as f:
            json.dump(batch, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), os.path.abspath(__file__), "--ranks", paths["jobs"], "--results",
               paths["results"], "--progress", paths["progress"]]
        timed_out = False
        with open(paths["log"], "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            current, since = None, time.monotonic()
            while proc.poll() is None:
                time.sleep(1.0)
                key = open(paths["progress"]).read() if os.path.exists(paths["progress"]) else None
                if key != current:
                    current, since = key, time.monotonic()
                elif time.monotonic() - since > job_timeout:
                    os.killpg(proc.pid, signal.SIGKILL)  # the launch this function started, and its ranks
                    proc.wait()
                    timed_out = True
        done = _read_results(paths["results"])
        results.update(done)
        left = [j for j in batch if j["key"] not in done]
        rest = pending[len(batch):]
        if left:
            stuck, text = left[0], open(paths["log"]).read()
            tries[stuck["key"]] = tries.get(stuck["key"], 0) + 1
            if not timed_out and any(s in text for s in LOST_RANK) and tries[stuck["key"]] < 2:
                rest = left + rest
            else:
                why = f"no result after {job_timeout:.0f} s (killed)" if timed_out else \
                    f"its launch ended (exit {proc.returncode})"
                results[stuck["key"]] = {"error": f"{why}: {_last_error(text)}", "log": paths["log"]}
                rest = left[1:] + rest
        pending = rest
        print(f"  launch {launch}: {len(done)} of {len(batch)} checks done, {len(pending)} left", flush=True)
    return results


# --------------------------------------------------------------------------
# The table.
# --------------------------------------------------------------------------

def _verdict(c: dict | None) -> str:
    if c is None:
        return "not run"
    if "error" in c:
        return "ERROR"
    errs = f"loss {c['loss_rel']:.0e}, grad {c['grad']:.0e}, param {c['param']:.0e}"
    if not c["agrees"]:
        return f"**FAILS** ({errs})"
    return f"agrees ({errs})" if c["param"] <= c["tol"] else f"agrees ({errs} <= drift {c['param_floor']:.0e})"


def table(rows: list, meshes: list) -> list[str]:
    out = ["| model | code base | kind | params | mesh | compile (s) | nodes | ops without a rule "
           "| sharded, solved | solved plan | sharding plan (seed: sharded) | sharding plan |",
           "|---|---|---|---:|---|---:|---:|---|---:|---|---|---|"]
    for row in rows:
        head = f"| {row['name']} | {row['code_base']} | {row['kind']} | {row.get('params', '')}"
        if "error" in row:
            out.append(f"{head} | all | | | | | ERROR: {row['error']} | | |")
            continue
        for mesh in meshes:
            r = row["meshes"][mesh]
            ops = ", ".join(f"`{op}`" for op in r.get("fallbacks", [])) or "none"
            random = f"{r['random_seed']}: {r['random_sharded']:.0%}" if "random_seed" in r else "ERROR"
            solver = "" if r.get("solver") == "OPTIMAL" else f" ({r.get('solver', 'not compiled')})"
            out.append(f"{head} | {mesh} | {r.get('compile_s', 0):.1f}{solver} | {r.get('nodes', '')} | {ops} "
                       f"| {format(r['sharded'], '.0%') if 'sharded' in r else ''} "
                       f"| {'compile ERROR' if 'compile_error' in r else _verdict(r.get('checks', {}).get('solved'))} "
                       f"| {random} "
                       f"| {_verdict(r.get('checks', {}).get('random'))} |")
    return out


def failures(rows: list) -> list[str]:
    out = []
    for row in rows:
        if "error" in row:
            out.append(f"- {row['name']}: {row['error']}")
            continue
        for mesh, r in row["meshes"].items():
            for what in ("compile_error", "random_error"):
                if what in r:
                    out.append(f"- {row['name']}, mesh {mesh}, {what.replace('_', ' ')}: {r[what]}")
            for plan, c in r.get("checks", {}).items():
                if "error" in c:
                    out.append(f"- {row['name']}, mesh {mesh}, {plan} plan: {c['error']}")
                elif not c["agrees"]:
                    out.append(f"- {row['name']}, mesh {mesh}, {plan} plan: disagrees with one device: loss "
                               f"{c['loss_rel']:.1e}, grad {c['grad']:.1e}, param {c['param']:.1e} (tolerance "
                               f"{c['tol']:.0e}, one device's drift {c['param_floor']:.1e})")
    return out


def summary(rows: list, meshes: list) -> list[str]:
    built = [r for r in rows if "error" not in r]
    bases = sorted({r["code_base"] for r in built})
    cells = [r["meshes"][m] for r in built for m in meshes]
    compiled = sum(1 for r in built if all("compile_error" not in r["meshes"][m] for m in meshes))
    checks = {p: [c["checks"][p] for c in cells if p in c.get("checks", {})] for p in PLANS}
    agree = {p: sum(1 for c in checks[p] if c.get("agrees")) for p in PLANS}
    sharding = [c["random_sharded"] for c in cells if "random_sharded" in c]
    solved_sharding = [c["sharded"] for c in cells if "sharded" in c]
    uncovered = sorted({op for c in cells for op in c.get("fallbacks", [])})
    shard_ok = sum(1 for r in built if all(r["meshes"][m].get("checks", {}).get("random", {}).get("agrees")
                                          and r["meshes"][m].get("random_sharded", 0) > 0 for m in meshes))
    return [
        f"- {len(rows)} models, {len(built)} built, from {len(bases)} code bases ({', '.join(bases)}); "
        f"meshes {', '.join(meshes)}.",
        f"- Compiled on every mesh: {compiled} of {len(built)}.",
        f"- Solved plans agree with one device: {agree['solved']} of {len(checks['solved'])} checks; they split "
        f"{sum(1 for f in solved_sharding if f > 0)} of {len(solved_sharding)} (model, mesh) parameter sets at all "
        f"(median fraction sharded {_median(solved_sharding):.0%}).",
        f"- Sharding plans agree with one device: {agree['random']} of {len(checks['random'])} checks; fraction of "
        f"parameters they split: median {_median(sharding):.0%}, least {min(sharding, default=0):.0%}.",
        f"- Models with a sharding plan that splits parameters and agrees on every mesh: {shard_ok} of {len(built)}.",
        f"- Ops without a rule (they run replicated): {', '.join(f'`{op}`' for op in uncovered) or 'none'}.",
    ]


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def markdown(rows: list, meshes: list, args, command: str, wall_s: float) -> str:
    import platform
    lines = [
        "# Coverage: the model zoo",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d', time.gmtime())} (torch {torch.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores shared; {wall_s / 60:.0f} min). Do not "
        "edit by hand: rerun the command.",
        "",
        "Models whose code this project did not write (benchmarks/model_zoo.py says how each is built: tiny "
        "configs, random weights, nothing downloaded, dropout off), compiled for each mesh with cluster "
        f"`{args.cluster}` and trained for 2 AdamW steps on {args.nproc} gloo ranks next to one device "
        "(autopar.verify.check: loss, every gradient, the parameters; tolerance 1e-5, the parameters also "
        "within the drift that gradients off by as much give one device). Two plans per mesh: the solved "
        "plan, and a sharding plan: the first random valid plan (every node a random strategy; seed 0, 1, ...) "
        f"that splits at least {args.min_sharded:.0%} of the parameters' elements.",
        "",
        *([f"Rows kept from an earlier run of the same script (`--resume`; their times are that run's): "
           f"{', '.join(args.resumed)}.", ""] if args.resumed else []),
        *([f"Not run (the run stopped at its `--budget` of {args.budget:g} min): {', '.join(args.not_run)}.", ""]
          if args.not_run else []),
        "## Summary",
        "",
        *summary(rows, meshes),
        "",
        "## Models",
        "",
        "Columns: *nodes*, the captured step's ops; *ops without a rule*, ops that run replicated on every "
        "device; *sharded, solved*: the fraction of the parameters' elements the solved plan splits; a check "
        "reads *agrees* or **FAILS** with the largest relative errors of the loss, the gradients and the "
        "parameters after 2 steps (*drift*: one device's own parameter error under gradient noise of the "
        "program's size, autopar.verify.agrees).",
        "",
        *table(rows, meshes),
        "",
        "## Failures",
        "",
        *(failures(rows) or ["None."]),
        "",
    ]
    return "\n".join(lines)


def check_rows(rows: list, args, work: str) -> None:
    """Check the plans of ``rows`` on ``args.nproc`` ranks; each result lands in its row."""
    jobs = [{"key": f"{row['name']}|{mesh}|{plan}", "source": row["source"], "mesh": mesh, "cluster": args.cluster,
             "plan": r[f"{plan}_plan"]}
            for row in rows for mesh, r in row["meshes"].items() for plan in PLANS if f"{plan}_plan" in r]
    if not jobs:
        return
    print(f"checking {len(jobs)} plans on {args.nproc} ranks ({work})", flush=True)
    for key, result in run_checks(jobs, work, args.group, args.job_timeout, args.nproc).items():
        name, mesh, plan = key.split("|")
        next(r for r in rows if r["name"] == name)["meshes"][mesh].setdefault("checks", {})[plan] = result


def _complete(row: dict, meshes: list) -> bool:
    """A row from an earlier run that this one can keep: the model could not
    be built, or every mesh has its plans compiled and checked."""
    return "error" in row or all(m in row["meshes"] and "random" in row["meshes"][m].get("checks", {}) and (
        "compile_error" in row["meshes"][m] or "solved" in row["meshes"][m]["checks"]) for m in meshes)


def _write(rows: list, meshes: list, args, argv, wall_s: float) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.write:
        command = "python benchmarks/model_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.write, "w") as f:
            f.write(markdown(rows, meshes, args, command.strip(), wall_s))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated names (default: every model); --list lists them")
    ap.add_argument("--list", action="store_true", help="list the models and exit")
    ap.add_argument("--meshes", default="4,2x2", help="comma-separated meshes (default 4,2x2)")
    ap.add_argument("--cluster", default="dgx-a100", help="cluster the solved plans are compiled for")
    ap.add_argument("--min-sharded", type=float, default=0.5,
                    help="fraction of the parameters' elements a sharding plan must split (default 0.5)")
    ap.add_argument("--plans", default="solved,random",
                    help="plans to make and check: solved, random or both (default)")
    ap.add_argument("--time-limit", type=float, default=10.0,
                    help="the solver's time limit per compile, in seconds (default 10; a plan it stopped "
                    "early on reads FEASIBLE in the table)")
    ap.add_argument("--seeds", type=int, default=20, help="random plans to try for a sharding plan")
    ap.add_argument("--group", type=int, default=16, help="checks per torchrun launch")
    ap.add_argument("--job-timeout", type=float, default=240.0, help="seconds before a check counts as hung")
    ap.add_argument("--nproc", type=int, default=4, help="ranks per launch (the meshes' size)")
    ap.add_argument("--no-checks", action="store_true", help="plans only: compile time, coverage, sharding")
    ap.add_argument("--workdir", help="where plans and launch logs go (default: a temporary directory)")
    ap.add_argument("--json", help="write the rows as JSON here (after every launch)")
    ap.add_argument("--resume", help="a --json file of an earlier run: its models checked on every mesh are kept, "
                    "not run again")
    ap.add_argument("--rerun", default="", help="comma-separated models to run again although --resume has them")
    ap.add_argument("--budget", type=float, help="minutes: start no more launches after this; the table lists "
                    "the models not run")
    ap.add_argument("--write", help="write the table as markdown here (docs/coverage.md)")
    ap.add_argument("--ranks", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.not_run, args.resumed, args.rerun = [], [], set(args.rerun.split(",")) - {""}
    if args.ranks:
        rank_main(args.ranks, args.results, args.progress)
        return 0
    if args.list:
        for e in ZOO:
            print(f"{e.name:18s} {e.code_base:18s} {e.kind:22s} {e.source}")
        return 0
    chosen = ZOO if not args.models else [e for e in ZOO if e.name in args.models.split(",")]
    unknown = set(args.models.split(",")) - {e.name for e in ZOO} if args.models else set()
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; --list lists them")
    meshes = args.meshes.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="autopar-zoo-")
    os.makedirs(work, exist_ok=True)
    start = time.perf_counter()
    resumed = {}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            resumed = {r["name"]: r for r in json.load(f) if _complete(r, meshes) and r["name"] not in args.rerun}
    rows = [resumed[e.name] for e in chosen if e.name in resumed]
    todo = [e for e in chosen if e.name not in resumed]
    chunk = max(1, args.group // (2 * len(meshes)))  # models per launch: a solved and a sharding plan per mesh
    for i in range(0, len(todo), chunk):
        if args.budget and time.perf_counter() - start > args.budget * 60:
            args.not_run = [e.name for e in todo[i:]]
            break
        batch = []
        for entry in todo[i:i + chunk]:
            t = time.perf_counter()
            batch.append(plan_model(entry, meshes, args.cluster, args.min_sharded, args.seeds, work,
                                    tuple(args.plans.split(",")), args.time_limit))
            batch[-1]["plan_s"] = time.perf_counter() - t
            print(f"planned {entry.name} ({batch[-1]['plan_s']:.1f} s)", flush=True)
        rows += batch
        if not args.no_checks:
            check_rows(batch, args, work)
        _write(rows, meshes, args, argv, time.perf_counter() - start)  # after every chunk: a stop keeps the rest
    args.resumed = sorted(resumed.keys() & {e.name for e in chosen})
    order = {e.name: i for i, e in enumerate(ZOO)}
    rows.sort(key=lambda r: order[r["name"]])
    _write(rows, meshes, args, argv, time.perf_counter() - start)
    print("\n".join(table(rows, meshes)))
    print("\n".join(["", *summary(rows, meshes), "", *failures(rows)]))
    print(f"wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
