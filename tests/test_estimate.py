"""``autopar estimate``: the transformer step's formulas, schedules and
orderings, plan validation, the published runs it is checked against, and
its command line, by table (no processes, no GPU)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys

import pytest
import torch

from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import axis_links
from autopar.cost_models.compute import op_time
from autopar.cost_models.estimate_cli import estimate_main
from autopar.cost_models.transformer import Fabric, estimate, kernel_times, stage_times
from autopar.cost_models.transformer_kernels import attention_kernels, layer_kernels, step_flops
from autopar.cost_models.transformer_memory import (layer_activation_bytes, model_state_bytes, stage_activation_bytes,
                                                    stage_params)
from autopar.cost_models.transformer_plan import (AttentionKernel, EstimateError, Precision, Recompute, TrainingPlan,
                                                  TransformerConfig, stage_layers)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A100 = get_cluster("dgx-a100")
GPT_1T = TransformerConfig(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)


def _validation_module(name: str = "validate_cost_model"):
    path = os.path.join(REPO, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# --- transformer: formulas ---------------------------------------------------------------------

def test_parameter_count_matches_megatron_formula():
    l, h, V, s = 128, 25600, 51200, 2048
    formula = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert GPT_1T.parameters() == pytest.approx(formula, rel=1e-6)  # we also count the final layer norm


def test_no_dropout_drops_the_masks_and_their_traffic(capsys):
    """A GPT block trained with p = 0 (MPT, GPT-NeoX) keeps no dropout masks:
    2 s b h bytes less per layer (the two residual dropouts, one byte per
    element), less streaming time, the same parameters; `--no-dropout` says so."""
    gpt = TransformerConfig(layers=4, hidden=1024, heads=8, seq=2048, vocab=51200)
    mpt = dataclasses.replace(gpt, no_dropout=True)
    plan = TrainingPlan(batch=8, microbatch=2, tp=1, pp=1, dp=1)
    s, b, h = gpt.seq, plan.microbatch, gpt.hidden
    assert layer_activation_bytes(gpt, plan) - layer_activation_bytes(mpt, plan) == 2 * s * b * h
    with_masks, without = estimate(gpt, plan, A100), estimate(mpt, plan, A100)
    assert without.time.compute_s < with_masks.time.compute_s and without.parameters == with_masks.parameters
    args = ["--layers", "4", "--hidden", "1024", "--heads", "8", "--seq", "2048", "--vocab", "51200", "--batch", "8",
            "--microbatch", "2", "--tp", "1", "--pp", "1", "--dp", "1", "--cluster", "dgx-a100", "--json"]
    assert estimate_main(args + ["--no-dropout"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(without.step_time_s)


@pytest.mark.parametrize("layers, hidden, heads, kv_heads, ffn, vocab, count", [
    (32, 4096, 32, 32, 11008, 32000, 6_738_415_616),  # Llama 2 7B
    (32, 4096, 32, 8, 14336, 128256, 8_030_261_248),  # Llama 3 8B
    (126, 16384, 128, 8, 53248, 128256, 405_853_388_800),  # Llama 3.1 405B
])
def test_llama_parameter_counts_are_exact(layers, hidden, heads, kv_heads, ffn, vocab, count):
    """The published checkpoints' parameter counts (their Hugging Face model
    cards' safetensors totals): SwiGLU blocks with grouped-query attention,
    RMSNorms, and an output layer untied from the embeddings."""
    llama = TransformerConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn,
                              swiglu=True, seq=4096, vocab=vocab, untied_embeddings=True)
    assert llama.parameters() == count
    tied = dataclasses.replace(llama, untied_embeddings=False)
    assert tied.parameters() == count - vocab * hidden
    one_stage = TrainingPlan(batch=8, microbatch=1)
    assert stage_params(llama, one_stage, 0) - stage_params(tied, one_stage, 0) == pytest.approx(vocab * hidden)
    two_stages = TrainingPlan(batch=8, microbatch=1, pp=2)  # the last stage holds an output layer either way
    assert [stage_params(llama, two_stages, i) for i in (0, 1)] == [stage_params(tied, two_stages, i) for i in (0, 1)]


@pytest.mark.parametrize("recompute, coefficient, vocab_term", [
    (Recompute.NONE, 72, 12),
    (Recompute.FULL, 96, 16),
])
def test_step_flops_match_megatron_formulas(recompute, coefficient, vocab_term):
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    plan = TrainingPlan(batch=B, microbatch=1, recompute=recompute)
    model_flops, hardware_flops = step_flops(GPT_1T, plan)
    expected = coefficient * B * s * l * h * h * (1 + s / (6 * h) + V / (vocab_term * l * h))
    assert hardware_flops == pytest.approx(expected, rel=1e-12)
    assert model_flops == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)


@pytest.mark.parametrize("zero, formula", [
    (0, lambda psi, nd: 16 * psi),
    (1, lambda psi, nd: 4 * psi + 12 * psi / nd),
    (2, lambda psi, nd: 2 * psi + 14 * psi / nd),
    (3, lambda psi, nd: 16 * psi / nd),
])
@pytest.mark.parametrize("nd", [1, 8, 64])
def test_zero_memory_formulas(zero, formula, nd):
    psi = 7.5e9
    plan = TrainingPlan(batch=nd, microbatch=1, dp=nd, zero=zero, precision=Precision.BF16)
    assert sum(model_state_bytes(psi, plan)) == pytest.approx(formula(psi, nd), rel=1e-12)


S, B_, H, A = 2048, 1, 12288, 96  # GPT-3 175B shapes, as in Korthikanti et al.


@pytest.mark.parametrize("tp, sp, recompute, formula", [
    (1, False, Recompute.NONE, lambda t: S * B_ * H * (34 + 5 * A * S / H)),
    (8, False, Recompute.NONE, lambda t: S * B_ * H * (10 + 24 / t + 5 * A * S / (H * t))),
    (8, True, Recompute.NONE, lambda t: S * B_ * H * (34 / t + 5 * A * S / (H * t))),
    (8, True, Recompute.SELECTIVE, lambda t: S * B_ * H * 34 / t),
    (1, False, Recompute.FULL, lambda t: 2 * S * B_ * H),
])
def test_activation_memory_matches_korthikanti(tp, sp, recompute, formula):
    model = TransformerConfig(layers=96, hidden=H, heads=A, seq=S, vocab=51200)
    plan = TrainingPlan(batch=1, microbatch=B_, tp=tp, sequence_parallel=sp, recompute=recompute,
                        precision=Precision.FP16, attention=AttentionKernel.UNFUSED)
    assert layer_activation_bytes(model, plan) == pytest.approx(formula(tp), rel=0.10)
    assert layer_activation_bytes(model, plan) == pytest.approx(formula(tp), rel=1e-9)  # exact for the GPT block


# --- transformer: schedule and orderings -----------------------------------------------------

def _estimate(model=GPT_1T, cluster=A100, nodes=None, **plan):
    plan = TrainingPlan(**{"batch": 64, "microbatch": 1, **plan})
    return estimate(model, plan, cluster, nodes or plan.world // cluster.devices_per_node)


@pytest.mark.parametrize("pp, v, m", [(2, 1, 8), (4, 1, 16), (8, 1, 64), (4, 2, 16), (8, 4, 32)])
def test_1f1b_bubble_fraction(pp, v, m):
    model = TransformerConfig(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200)
    est = _estimate(model, batch=m, tp=8, pp=pp, dp=1, virtual_stages=v)
    t = est.time
    busy = t.compute_s + t.tp_comm_s + t.pp_comm_s
    assert t.bubble_s / busy == pytest.approx((pp - 1) / (v * m), rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_moves_as_much_as_tensor_parallel_and_saves_memory(tp):
    model = TransformerConfig(layers=8, hidden=4096, heads=32, seq=2048, vocab=51200)
    plain = _estimate(model, batch=8, tp=tp, dp=8 // tp)
    sp = _estimate(model, batch=8, tp=tp, dp=8 // tp, sequence_parallel=True)
    assert sp.time.tp_comm_s == pytest.approx(plain.time.tp_comm_s, rel=0.05)
    assert sp.memory.activations < plain.memory.activations


@pytest.mark.parametrize("recompute", list(Recompute))
@pytest.mark.parametrize("attention", list(AttentionKernel))
def test_sequence_parallel_shards_every_activation_of_a_first_stage(recompute, attention):
    """Under sequence parallelism nothing a first (not last) pipeline stage keeps
    for backward is replicated over the tensor-parallel group: layer norms,
    dropouts, the embedding output and its mask are all scattered along the
    sequence, so t GPUs hold exactly 1/t each of what one GPU would hold."""
    model = TransformerConfig(layers=8, hidden=4096, heads=32, seq=2048, vocab=51200)
    plan = dict(batch=16, microbatch=1, pp=4, dp=1, recompute=recompute, attention=attention)
    one = stage_activation_bytes(model, TrainingPlan(tp=1, **plan), 0)
    eight = stage_activation_bytes(model, TrainingPlan(tp=8, sequence_parallel=True, **plan), 0)
    assert eight == pytest.approx(one / 8, rel=1e-12)


def test_recomputation_trades_time_for_memory():
    model = TransformerConfig(layers=8, hidden=4096, heads=32, seq=2048, vocab=51200)
    runs = {r: _estimate(model, batch=8, tp=8, recompute=r, attention=AttentionKernel.UNFUSED) for r in Recompute}
    assert runs[Recompute.FULL].memory.activations < runs[Recompute.SELECTIVE].memory.activations \
        < runs[Recompute.NONE].memory.activations
    assert runs[Recompute.NONE].step_time_s < runs[Recompute.SELECTIVE].step_time_s < runs[Recompute.FULL].step_time_s
    assert runs[Recompute.FULL].hardware_tflops_per_gpu > runs[Recompute.FULL].tflops_per_gpu


def test_zero3_at_fixed_global_batch_stops_scaling_once_communication_bound():
    """ZeRO-3 (FSDP) of a 7B GPT at a fixed global batch of 2,048 sequences
    as data parallelism grows from 16 to 2,048 A100s: every GPU gathers
    every layer's weights in forward and again in backward and
    reduce-scatters their gradients whatever the group's size, so its bytes
    per GPU stay put while its compute shrinks as 1/d, and the ring's steps
    grow with the group (collectives._flat_ring: 2,048 devices wait 1,792
    NVLink hops and 255 network hops per collective). Compute-bound,
    quadrupling d quarters the step; past the crossing the step stops
    shrinking, and throughput per GPU falls steeply instead of staying flat.
    The floor is each layer's gathers and reduction per microbatch."""
    model = TransformerConfig(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200, no_dropout=True)
    steps = {dp: estimate(model, TrainingPlan(batch=2048, microbatch=2048 // dp, dp=dp, zero=3), A100)
             for dp in (16, 64, 256, 1024, 2048)}
    step = {dp: est.step_time_s for dp, est in steps.items()}
    assert step[64] / step[16] == pytest.approx(0.25, rel=0.02)  # compute-bound: linear
    assert step[256] / step[64] == pytest.approx(0.25, rel=0.02)
    assert step[2048] / step[1024] > 0.9  # communication-bound: no faster with twice the GPUs
    fabric = Fabric.make(TrainingPlan(batch=2048, microbatch=1, dp=2048, zero=3), A100)
    sharded, replicated = model.layer_params()
    layer = 2 * (sharded + replicated)  # bytes of a layer's bf16 weights
    floor = model.layers * (2 * fabric.time("all_gather", layer, "dp") + fabric.time("reduce_scatter", layer, "dp"))
    assert step[2048] > floor
    assert steps[2048].tokens_per_s_per_gpu < 0.5 * steps[16].tokens_per_s_per_gpu  # near-linear would keep it


def test_zero3_gathers_hide_under_long_layers_only():
    """Prefetched one layer ahead, a layer's gathers hide under a long
    layer's compute and show under a short one's; blocking (as autopar's
    runtime gathers today), they show either way."""
    for seq, exposed in ((4096, False), (128, True)):
        model = TransformerConfig(layers=8, hidden=4096, heads=32, seq=seq, vocab=51200)
        z3 = _estimate(model, batch=64, dp=16, zero=3)
        fabric = Fabric.make(TrainingPlan(batch=64, microbatch=1, dp=16, zero=3), A100)
        sharded, replicated = model.layer_params()
        gather = fabric.time("all_gather", 2 * (sharded + replicated), "dp")
        layers = z3.time.dp_comm_s - _estimate(model, batch=64, dp=16, zero=3).time.dp_comm_s
        assert layers == 0
        stage = stage_times(model, TrainingPlan(batch=64, microbatch=1, dp=16, zero=3), A100, fabric)[0]
        assert (gather > stage.compute.forward / model.layers) is exposed
        blocking = _estimate(model, batch=64, dp=16, zero=3, overlap_param_gather=False)
        assert blocking.time.dp_comm_s > z3.time.dp_comm_s + model.layers * gather


def test_tensor_parallelism_across_nodes_is_slower():
    model = TransformerConfig(layers=8, hidden=4096, heads=32, seq=2048, vocab=51200)
    inside = _estimate(model, batch=16, tp=8, dp=2)
    # The same 16 GPUs with tp spanning two nodes (as the outer axis would).
    across = _estimate(model, batch=16, tp=16, dp=1)
    assert across.time.tp_comm_s > 2 * inside.time.tp_comm_s


def test_concurrent_axes_share_a_link_only_on_the_same_level():
    """Several mesh axes driving one link at once. The data-parallel sync
    hides under the backward compute; a tensor-parallel collective on the
    critical path stalls that compute, which is hiding time only where the
    sync runs on another link (dp between nodes, tp on NVSwitch), and
    tensor-parallel traffic overlapped with the GEMMs (--tp-comm-overlap)
    takes its share of its link, which is the sync's to wait where they
    share it. The same 8 GPUs as one node (tp and dp on NVSwitch) expose
    more gradient sync than as two nodes whose network is as fast (dp
    between nodes), and overlapping tp's traffic exposes more there still,
    by as much as it hides, once the sync is what bounds."""
    one = dataclasses.replace(A100, name="one-node", devices_per_node=8)
    two = dataclasses.replace(A100, name="two-nodes", devices_per_node=4, inter_node=A100.intra_node)
    tp, dp = axis_links(one, (1, 2, 4))[1:][::-1]
    assert tp.shares_link(dp) and tp.levels == dp.levels == {"intra"}
    tp2, dp2 = axis_links(two, (1, 2, 4))[1:][::-1]
    assert not tp2.shares_link(dp2) and dp2.levels == {"inter"}
    model = TransformerConfig(layers=4, hidden=4096, heads=32, seq=128, vocab=51200)  # short: sync > compute
    plan = dict(batch=2, tp=4, dp=2, sequence_parallel=True)
    shared = _estimate(model, cluster=one, nodes=1, **plan)
    apart = _estimate(model, cluster=two, nodes=2, **plan)
    assert shared.time.tp_comm_s == pytest.approx(apart.time.tp_comm_s)
    assert shared.time.dp_comm_s > apart.time.dp_comm_s
    overlapped = dict(plan, tp_comm_overlap=True)
    shared_o, apart_o = (_estimate(model, cluster=c, nodes=k, **overlapped) for c, k in ((one, 1), (two, 2)))
    stage = stage_times(model, TrainingPlan(microbatch=1, **overlapped), one,
                        Fabric.make(TrainingPlan(microbatch=1, **overlapped), one))[0]
    hidden = stage.tp_hidden.backward + stage.tp_hidden.recompute
    assert hidden > 0 and shared_o.time.tp_comm_s < shared.time.tp_comm_s  # the overlap hides tp traffic
    assert shared_o.time.dp_comm_s - shared.time.dp_comm_s == pytest.approx(hidden, rel=1e-6)
    assert apart_o.time.dp_comm_s >= apart.time.dp_comm_s  # apart it only loses the stall it hid under


def test_tensor_parallel_overlap_hides_collectives_under_their_gemms():
    """--tp-comm-overlap (Megatron-Core, Transformer Engine's userbuffers)
    on GPT-3 175B's layers at t = 8 on H100s: each all-gather pipelined in
    tp chunks with the GEMM it feeds, each reduce-scatter in 4 with the GEMM
    it drains (whose 132 SMs lose 16 to it), so what is exposed follows
    overlap.chunked_overlap; the step is faster, and the option needs
    sequence parallelism, as Megatron's does."""
    from autopar.cost_models.overlap import chunked_overlap
    from autopar.cost_models.transformer import tp_layer_comm
    h100 = get_cluster("dgx-h100")
    model = TransformerConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    base = TrainingPlan(batch=1536, microbatch=1, tp=8, pp=8, dp=16, virtual_stages=3, sequence_parallel=True,
                        recompute="selective")
    plan = dataclasses.replace(base, tp_comm_overlap=True)
    fabric = Fabric.make(plan, h100)
    gemms = {k.name: k.seconds(h100.device, "bf16")[0] for k in layer_kernels(model, plan) if k.matmul}
    nbytes = 2 * model.seq * model.hidden
    ag, rs = fabric.time("all_gather", nbytes, "tp"), fabric.time("reduce_scatter", nbytes, "tp")
    slower = 16 / (132 - 16)
    expected = sum(chunked_overlap(ag, gemms[into], 8) + chunked_overlap(rs, gemms[out] * (1 + slower), 4)
                   + gemms[out] * slower for into, out in (("qkv", "attention-out"), ("mlp-in", "mlp-out")))
    assert tp_layer_comm(model, plan, fabric, gemms, h100.device).forward == pytest.approx(expected)
    assert tp_layer_comm(model, base, fabric).forward == pytest.approx(2 * (ag + rs))
    on, off = estimate(model, plan, h100), estimate(model, base, h100)
    assert on.time.tp_comm_s < 0.5 * off.time.tp_comm_s and on.step_time_s < off.step_time_s
    with pytest.raises(EstimateError, match="--tp-comm-overlap .* needs tp > 1 .* and --sequence-parallel"):
        estimate(model, dataclasses.replace(plan, sequence_parallel=False), h100)


def test_megatron_table_mape():
    validation = _validation_module()
    results = validation.predict_megatron()
    assert len(results) == 10
    assert validation.mape(results) <= 0.10
    assert validation.max_error(results) <= 0.20


def test_out_of_sample_published_runs():
    """Korthikanti et al. 2022's four runs (sequence parallelism, selective
    recomputation) are predicted with the constants fitted on the 2021 table
    alone. They ran, so the model must also say that they fit in 80 GB (the 1T
    run did not while the embedding output was counted unsharded)."""
    validation = _validation_module()
    results = validation.predict_selective()
    assert len(results) == 4
    errors = [abs(r.error) for r in results]
    assert sum(errors) / len(errors) <= 0.10 and max(errors) <= 0.20
    for r in results:
        assert r.estimate.peak_memory_bytes <= A100.device.memory, r.row


def test_kernel_times_runs_each_layer_matmul_at_its_shape_on_the_cpu(tmp_path):
    """benchmarks/kernel_times.py, the GPU item's prepared script, on the
    CPU: every GEMM and the attention of a layer run at the shapes the cost
    model prices (GQA heads and tensor parallelism included), each next to
    its op_time; its section replaces section 3 of the validation document,
    which validate_cost_model keeps when it rewrites the rest."""
    kt = _validation_module("kernel_times")
    cpu = get_cluster("cpu")
    table = kt.rows(kt.CPU_SHAPES, cpu, torch.device("cpu"), repeats=1)
    names = ["qkv", "flash-attention", "attention-out", "mlp-in", "mlp-out"]
    assert [r["kernel"] for r in table] == names * 2
    llama = {r["kernel"]: r for r in table[5:]}
    assert llama["qkv"]["dims"] == (1, 128, 256, 256)  # (h + 2 kv_hidden) / t = (256 + 256) / 2
    assert llama["flash-attention"]["dims"] == (1, 2, 1, 128, 64)  # 4 / 2 query heads, 2 / 2 key/value heads
    assert llama["mlp-in"]["dims"] == (1, 128, 256, 512)  # gate and up: 2 * 512 / 2
    for r in table:
        assert all(t > 0 for t in r["measured"]) and all(t > 0 for t in r["predicted"])
    qkv = table[0]
    flops = 2.0 * 256 * 256 * 768
    assert qkv["predicted"][0] == pytest.approx(op_time(flops, 4.0 * (256 * 256 + 256 * 768 + 256 * 768), cpu.device,
                                                        "fp32", matmul=True))
    doc = tmp_path / "validation.md"
    doc.write_text("# head\n\n## 2. Measured\n\ntext\n")
    kt.write_section(kt.report(table, cpu, "the CPU", 1, gpu=False), str(doc))
    kt.write_section(kt.report(table[:1], cpu, "the CPU", 1, gpu=False), str(doc))  # replaces, not appends
    text = doc.read_text()
    assert text.startswith("# head\n\n## 2. Measured\n\ntext\n\n## 3. Kernel times on a GPU")
    assert text.count("## 3.") == 1 and text.count("| qkv |") == 1 and "flash-attention" not in text
    validation = _validation_module()
    assert validation.KERNEL_SECTION == kt.SECTION
    rewritten = validation.with_kernel_section("# new report\n", text)
    assert rewritten.startswith("# new report\n\n## 3. Kernel times") and rewritten.count("| qkv |") == 1
    assert validation.with_kernel_section("# new\n", "# old\n").endswith(validation.KERNEL_PLACEHOLDER)


def test_fsdp_runs_are_the_published_runs_and_short_sequences_on_the_a100_stay_close():
    """MosaicML's 191 FSDP runs as transcribed: each row's MFU follows from
    its tokens per second by MosaicML's own formula, its global batch is
    microbatch x accumulation x GPUs, and the MPT model written for it has
    the published parameter count exactly. On both A100s the estimate stays
    within 10% MAPE at s <= 4096 and 12% beyond (6.7% / 8.1% and 5.7% / 4.6%
    when written down, their Triton kernel priced as FlashAttention's first
    generation), and its memory fits nearly every run (all ran: 187 of 191
    fit, the rest within 2%); the report names the H100's gap rather than
    hiding it."""
    import csv
    fsdp = _validation_module("fsdp_runs")
    runs = fsdp.load_runs()
    assert len(runs) == 191 and {r.gpu for r in runs} == {"a100_80gb", "a100_40gb", "h100_80gb"}
    with open(fsdp.CSV) as f:
        raw = list(csv.DictReader(f))
    for run, row in zip(runs, raw):
        hidden, _, layers = fsdp.MPT[run.model]
        peak = 989e12 if run.gpu == "h100_80gb" else 312e12
        flops_per_seq = 6 * run.published_params * run.seq + 12 * layers * hidden * run.seq ** 2
        mfu = flops_per_seq * run.published_tokens / run.seq / peak
        assert mfu == pytest.approx(float(row["mfu_pct"]) / 100, rel=0.01), row
        assert run.global_batch == run.microbatch * int(row["grad_accum"]) * run.gpus, row
        assert run.config.parameters() == run.published_params, row
    results = fsdp.predict_fsdp(runs)
    for gpu in ("a100_80gb", "a100_40gb"):
        short, long, _ = fsdp.summary(results, gpu)
        assert short <= 10.0 and long <= 12.0
    over = [r.estimate.peak_memory_bytes / r.estimate.memory_capacity_bytes for r in results
            if not r.estimate.fits_in_memory]
    assert len(over) <= 0.05 * len(results) and max(over, default=1.0) < 1.05  # they all ran
    short, long, h100_fast = fsdp.summary(results, "h100_80gb")
    caveat = get_cluster("dgx-h100").caveat  # the preset's warning, current
    assert f"{h100_fast:.0f}% fast on average" in caveat and f"(MAPE {short:.1f}%)" in caveat
    # The H100's scaled GEMM fraction and synchronous-MMA fraction (no fit to
    # these runs) keep it within 20% on average at every length.
    assert short <= 20.0 and long <= 20.0
    llama = [r.error for r in _validation_module().predict_other() if r.run.name.startswith("Llama 3 405B")]
    assert ", ".join(f"{100 * e:+.0f}%".replace("+", "") for e in llama) in caveat
    text = "\n".join(fsdp.fsdp_section(results) + fsdp.discussion(results))
    assert "h100_80gb (52 runs" in text and "faster on 8 H100s than on 8 A100s" in text


def test_fsdp_runs_gathers_and_fp32_reductions_would_hide_under_the_compute():
    """The report's claim about MosaicML's FSDP runs: reduce-scattered in fp32
    (Composer's DEFAULT since October 2023) instead of the estimate's bf16, a
    layer's collectives would still take less than its compute in every run;
    on links 100 times slower they would not."""
    import dataclasses
    fsdp = _validation_module("fsdp_runs")
    share = fsdp.fp32_reduction_share()
    assert 0.0 < share < 1.0
    text = "\n".join(fsdp.fsdp_section(fsdp.predict_fsdp()))
    assert f"at most {share:.2f} of its compute" in text

    def slow(link):
        return dataclasses.replace(link, bandwidth=link.bandwidth / 100)
    slower = {gpu: dataclasses.replace(c, intra_node=slow(c.intra_node), inter_node=slow(c.inter_node))
              for gpu, c in fsdp.CLUSTERS.items()}
    assert fsdp.fp32_reduction_share(clusters=slower) > 1.0


def test_other_published_runs_are_the_published_models_and_stay_close():
    """The out-of-sample runs of docs/validation.md (BLOOM, Llama 3 405B and
    70B, torchtitan's Llama 2 and 3, MT-NLG) are the published models (their
    parameter counts) on valid plans, and stay within the acceptance's 25%
    per row (Llama 3 on 16,384 H100s is the farthest of the Megatron-like
    runtimes, at about -20% with the assumed interleaving depth v = 2), and
    MT-NLG, whose DeepSpeed pipeline the model does not price, is predicted
    faster than it ran (the documented gap), never slower."""
    validation = _validation_module()
    published = {"BLOOM": 176.247e9, "Llama 3 405B": 405_853_388_800, "Llama 3 70B": 70_553_706_496,
                 "Llama 2 13B": 13_015_864_320, "Llama 2 70B": 68_976_648_192, "MT-NLG": 530e9}
    for r in validation.predict_other():
        count = next(v for k, v in published.items() if r.run.name.startswith(k))
        assert r.run.model.parameters() == pytest.approx(count, rel=2e-3), r.run.name
        if r.run.name.startswith("MT-NLG"):
            assert 0 < r.error < 0.25, r.run.name
        else:
            assert abs(r.error) <= 0.25, (r.run.name, r.error)  # issue 26's acceptance: no row beyond 25%


# --- one accounting: estimate against the planner's books ----------------------------------------

GPT_SHAPE = dict(layers=2, hidden=2048, heads=16, seq=1024, vocab=51200)
"""GPT shapes (a 2048-wide GPT-3 XL layer, GPT-2's vocabulary padded as Megatron pads it), two layers: the
per-layer books are what is compared, and two layers keep the compiles to seconds."""


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"autopar_examples_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _megatron_placements(model, tp: int, dp: int, zero: int) -> dict:
    """A hand plan's parameter placements for examples/gpt.py: Megatron's column and row splits and the
    vocabulary-parallel embedding and head over tp; replicated, or ZeRO-sharded over dp (trailing
    "regather" for ZeRO-3)."""
    out = {}
    for name, p in model.named_parameters():
        t = "R"
        if tp > 1 and (name in ("tok.weight", "head.weight") or name.endswith(
                ("q.weight", "k.weight", "v.weight", "fc.weight", "fc.bias"))):
            t = "S(0)"
        elif tp > 1 and name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            t = "S(1)"
        d = "R"
        if zero >= 2 and dp > 1 and not (t == "S(0)" and p.dim() == 1):
            d = "S(1)" if t == "S(0)" else "S(0)"
        out[name] = ([d] if dp > 1 else []) + ([t] if tp > 1 else []) + (["regather"] if zero == 3 and d != "R" else [])
    return out


@pytest.mark.parametrize("tp, dp, pp, zero, recompute, batch", [
    (1, 8, 1, 0, "none", 16),
    (1, 8, 1, 2, "none", 16),
    (1, 8, 1, 3, "none", 16),
    (1, 8, 1, 0, "full", 16),
    (8, 1, 1, 0, "none", 2),
    (4, 2, 1, 0, "none", 8),
    (2, 4, 1, 3, "none", 16),
    (1, 1, 2, 0, "none", 16),
    (1, 1, 2, 0, "full", 16),
])
def test_estimate_and_a_pinned_compile_agree(tp, dp, pp, zero, recompute, batch):
    """The acceptance of issue 26: for a GPT shape and a hand plan, ``autopar
    estimate`` (eager kernels, torch.optim's AdamW, no prefetch: what
    autopar's programs run) and the planner's own books agree within 2% on
    step time and peak memory. The flat plans are priced by the ILP with
    every weight and input pinned and the ops that read weights held to them
    (autopar/pinned.py); the pipelines by ``autopar compile`` on a pp mesh
    (one stage per device, 1F1B), their stage split taken as the estimate's."""
    G = _example("gpt")
    from autopar import compile as compile_plan
    from autopar.pinned import compile_pinned
    shape = dict(GPT_SHAPE, layers=GPT_SHAPE["layers"] * pp)  # a pipeline: two layers per stage
    cfg = G.GPTConfig(vocab=shape["vocab"], seq=shape["seq"], hidden=shape["hidden"], heads=shape["heads"],
                      layers=shape["layers"])
    with torch.device("meta"):
        model = G.GPT(cfg)
        idx = torch.zeros(batch, cfg.seq, dtype=torch.long)
    inputs = (idx, idx.clone())
    first = last = None
    if pp > 1:
        microbatches = 4
        plan = compile_plan(model, inputs, loss_fn=G.lm_loss, mesh=f"pp={pp}", cluster="dgx-a100",
                            precision="bf16", recompute=recompute, microbatches=microbatches, schedule="1f1b")
        first, *_, last = [sum(x.startswith("blocks.") for x in st["layers"]) for st in plan.pipeline["stages"]]
    else:
        microbatches = 1
        mesh = ",".join(f"{n}={k}" for n, k in (("dp", dp), ("tp", tp)) if k > 1)
        split = (["S(0)"] if dp > 1 else []) + (["R"] if tp > 1 else [])
        plan = compile_pinned(model, inputs, loss_fn=G.lm_loss, mesh=mesh, cluster="dgx-a100", precision="bf16",
                              recompute=recompute, parameter_placements=_megatron_placements(model, tp, dp, zero),
                              input_placements={0: split, 1: split})
    gpt = TransformerConfig(**shape, no_dropout=True, untied_embeddings=True)
    est = estimate(gpt, TrainingPlan(
        batch=batch, microbatch=batch // (dp * microbatches), tp=tp, dp=dp, pp=pp, zero=zero, recompute=recompute,
        sequence_parallel=tp > 1, kernels="eager", optimizer="adamw", overlap_param_gather=False,
        first_stage_layers=first, last_stage_layers=last), A100)
    predicted = plan.predicted
    assert est.step_time_s == pytest.approx(predicted["step_time_s"], rel=0.02)
    assert est.peak_memory_bytes == pytest.approx(predicted["peak_memory_bytes"], rel=0.02)


# --- plan validation ----------------------------------------------------------------------

ONE_PER_NODE = dataclasses.replace(A100, name="one-per-node", devices_per_node=1)


@pytest.mark.parametrize("plan, cluster, nodes, message", [
    (dict(tp=8, pp=2, dp=2), A100, 2,
     r"tp\(8\) \* pp\(2\) \* dp\(2\) = 32 != nodes\(2\) \* devices_per_node\(8\) = 16"),
    (dict(tp=4), get_cluster("cpu"), 2, r"cluster 'cpu' has 1 node\(s\); 2 requested"),
    (dict(tp=3), ONE_PER_NODE, 3, r"heads \(160\) must be divisible by tp \(3\)"),
    (dict(pp=3), ONE_PER_NODE, 3, r"layers \(128\) must be divisible by pp \(3\)"),
    (dict(batch=10, dp=4), ONE_PER_NODE, 4, r"batch \(10\) must be divisible by microbatch \(1\) \* dp \(4\)"),
    (dict(virtual_stages=2), ONE_PER_NODE, 1, r"virtual-stages > 1 needs pp > 1"),
    (dict(pp=3, first_stage_layers=41), ONE_PER_NODE, 3,
     r"layers \(128\) = first-stage-layers \(41\) \+ 87 left, which cannot give the other 2 stage\(s\)"),
    (dict(pp=2, first_stage_layers=60, last_stage_layers=60), ONE_PER_NODE, 2,
     r"layers \(128\) = first-stage-layers \(60\) \+ last-stage-layers \(60\) \+ 8 left, which cannot give no other"),
    (dict(pp=4, virtual_stages=4, first_stage_layers=2, last_stage_layers=2), ONE_PER_NODE, 4,
     r"every stage needs at least virtual-stages \(4\) layers; the stages have \[2, 62, 62, 2\]"),
    (dict(first_stage_layers=1), ONE_PER_NODE, 1, r"first-stage-layers / last-stage-layers need pp > 1"),
    (dict(pp=2, first_stage_layers=0), ONE_PER_NODE, 2, r"first_stage_layers must be a positive integer, got 0"),
])
def test_invalid_plans_say_why(plan, cluster, nodes, message):
    with pytest.raises(EstimateError, match=message):
        estimate(GPT_1T, TrainingPlan(**{"batch": 64, "microbatch": 1, **plan}), cluster, nodes)


def test_first_generation_flash_attention_takes_twice_flash_attention_2s_time():
    """`--attention flash1` (FlashAttention-1 or its Triton port) is the same
    fused kernel and memory at half FlashAttention-2's speed (Dao 2023:
    "around 2x"); context parallelism needs FlashAttention-2's ring."""
    model = TransformerConfig(layers=2, hidden=1024, heads=8, seq=8192, vocab=51200)
    fa2 = TrainingPlan(batch=8, microbatch=1, tp=1, pp=1, dp=8)
    fa1 = dataclasses.replace(fa2, attention="flash1")
    t2, t1 = (kernel_times(attention_kernels(model, p), p, A100, True) for p in (fa2, fa1))
    assert t1.forward == pytest.approx(2 * t2.forward) and t1.backward == pytest.approx(2 * t2.backward)
    assert layer_activation_bytes(model, fa1) == layer_activation_bytes(model, fa2)
    gap = estimate(model, fa1, A100).time.compute_s - estimate(model, fa2, A100).time.compute_s
    assert gap == pytest.approx(model.layers * (t2.forward + t2.backward))  # one microbatch per GPU
    with pytest.raises(EstimateError, match=r"context parallelism needs --attention flash .*--attention flash1"):
        estimate(model, dataclasses.replace(fa1, cp=2, dp=4), A100)


def test_flash_attention_3_is_faster_on_hopper_and_costs_the_same_memory():
    """`--attention flash3` prices FlashAttention-3: on an H100 at the full
    GEMM rate (FlashAttention-2 pays the synchronous-MMA fraction) with its
    exponentials overlapped; on an A100 only the overlap differs. Memory is
    the same fused kernel's."""
    model = TransformerConfig(layers=2, hidden=2048, heads=16, seq=8192, vocab=51200)
    fa2 = TrainingPlan(batch=8, microbatch=1, tp=1, pp=1, dp=8)
    fa3 = dataclasses.replace(fa2, attention="flash3")
    h100 = get_cluster("dgx-h100")
    for cluster in (A100, h100):
        t2, t3 = (kernel_times(attention_kernels(model, p), p, cluster, True) for p in (fa2, fa3))
        assert t3.forward < t2.forward and t3.backward < t2.backward
        assert layer_activation_bytes(model, fa3) == layer_activation_bytes(model, fa2)
    a2, a3 = (kernel_times(attention_kernels(model, p), p, A100, True) for p in (fa2, fa3))
    h2, h3 = (kernel_times(attention_kernels(model, p), p, h100, True) for p in (fa2, fa3))
    assert h2.forward / h3.forward > a2.forward / a3.forward  # Hopper gains the MMA rate too


def test_flash_attention_pays_one_exponential_per_score_forward_and_backward():
    """Each layer's FlashAttention computes b a s^2 / 2 causal scores and
    evaluates an exponential for each, forward and again in backward, at the
    device's SFU rate: the step takes exactly that much longer than on the
    same device without the rate, and the unfused kernels pay nothing."""
    model = TransformerConfig(layers=4, hidden=1024, heads=8, seq=8192, vocab=51200)
    h100 = get_cluster("dgx-h100")
    no_sfu = dataclasses.replace(h100, device=dataclasses.replace(h100.device, special_function_rate=0.0))
    plan = TrainingPlan(batch=16, microbatch=2, tp=1, pp=1, dp=8)
    scores = plan.microbatch * model.heads * model.seq ** 2 / 2
    extra = model.layers * 2 * scores / h100.device.special_function_rate * (16 // (2 * 8))
    with_sfu, without = estimate(model, plan, h100), estimate(model, plan, no_sfu)
    assert with_sfu.time.compute_s - without.time.compute_s == pytest.approx(extra, rel=1e-9)
    unfused = dataclasses.replace(plan, attention="unfused")
    assert estimate(model, unfused, h100).step_time_s == estimate(model, unfused, no_sfu).step_time_s


def test_context_parallelism_splits_tokens_and_rings_keys_and_values(capsys):
    """cp = 2 halves every token-proportional FLOP and activation byte of a
    layer (attention does half the causal work); the ring's key/value
    exchange hides under a long sequence's attention and shows under a
    short one's; gradients reduce over dp x cp."""
    llama = TransformerConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, swiglu=True,
                              seq=32768, vocab=128256, untied_embeddings=True)
    one = TrainingPlan(batch=16, microbatch=1, tp=4, dp=2, sequence_parallel=True)
    two = dataclasses.replace(one, cp=2)
    flops = lambda plan: sum(k.fwd_flops + k.bwd_flops for k in layer_kernels(llama, plan))  # noqa: E731
    assert flops(two) == pytest.approx(flops(one) / 2)
    assert layer_activation_bytes(llama, two) == pytest.approx(layer_activation_bytes(llama, one) / 2)
    h100 = get_cluster("dgx-h100")
    assert Fabric.make(two, h100).dp.size == 4 and Fabric.make(two, h100).cp.size == 2
    long = estimate(llama, two, h100)
    assert long.world_size == 16 and long.time.cp_comm_s == 0.0  # 32K tokens of attention hide the ring
    short = estimate(dataclasses.replace(llama, seq=2048), dataclasses.replace(two, cp=8, tp=1), h100)
    assert short.time.cp_comm_s > 0
    args = ("--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --swiglu --seq 32768 "
            "--vocab 128256 --batch 16 --microbatch 1 --tp 4 --cp 2 --pp 1 --dp 2 --sequence-parallel "
            "--cluster dgx-h100").split()
    assert estimate_main(args) == 0
    assert "context-parallel comm" in capsys.readouterr().out
    for plan, message in ((dataclasses.replace(two, cp=3, sequence_parallel=False), r"seq \(32768\) must be divisible by 2 \* cp \(6\)"),
                          (dataclasses.replace(two, attention="unfused"), r"context parallelism needs --attention flash"),
                          (dataclasses.replace(two, tp=2, dp=3, batch=18),
                           r"tp\(2\) \* cp\(2\) \* pp\(1\) \* dp\(3\) = 12 GPUs do not fill whole nodes")):
        with pytest.raises(EstimateError, match=message):
            estimate(llama, plan, h100)


def test_uneven_stages_pin_the_first_and_last_and_the_slowest_sets_the_pace():
    """Llama 3 405B's split (126 layers on 16 stages, one fewer on the first
    and the last): the middle stages keep 8, the pinned ones 7; pinning the
    even share changes nothing; a heavier first stage becomes the slowest."""
    llama = TransformerConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, swiglu=True,
                              seq=8192, vocab=128256)
    plan = TrainingPlan(batch=2048, microbatch=1, tp=8, pp=16, dp=64, virtual_stages=2,
                        first_stage_layers=7, last_stage_layers=7)
    assert stage_layers(llama, plan) == (7,) + (8,) * 14 + (7,)
    flat = dataclasses.replace(plan, virtual_stages=1, sequence_parallel=True)
    assert estimate(llama, flat, get_cluster("dgx-h100"), 1024).memory.stage == 1  # 8 x 15 in flight > 7 x 16

    even = TrainingPlan(batch=64, microbatch=1, pp=4)
    pinned = dataclasses.replace(even, first_stage_layers=32, last_stage_layers=32)
    assert estimate(GPT_1T, pinned, ONE_PER_NODE, 4) == estimate(GPT_1T, even, ONE_PER_NODE, 4)
    assert estimate(GPT_1T, even, ONE_PER_NODE, 4).stage_layers == (32, 32, 32, 32)
    from autopar.cost_models.estimate_cli import _stage_layers
    assert _stage_layers(stage_layers(llama, plan)) == "7, 8 x 14, 7" and _stage_layers((5, 6, 6)) == "5, 6 x 2"

    heavy = dataclasses.replace(even, first_stage_layers=38, last_stage_layers=30)  # 30 left for the other two
    assert stage_layers(GPT_1T, heavy) == (38, 30, 30, 30)
    fabric = Fabric.make(even, ONE_PER_NODE)
    layer = kernel_times(layer_kernels(GPT_1T, even), even, ONE_PER_NODE, recompute=True).total
    before, after = (stage_times(GPT_1T, p, ONE_PER_NODE, fabric) for p in (even, heavy))
    assert after[0].compute.total - before[0].compute.total == pytest.approx(6 * layer)
    assert max(after, key=lambda st: st.total) is after[0]
    slower = estimate(GPT_1T, heavy, ONE_PER_NODE, 4).time
    assert slower.compute_s == pytest.approx(heavy.microbatches * after[0].compute.total)



# --- CLI --------------------------------------------------------------------------------------

ESTIMATE_ARGS = ("--layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --batch 64 --microbatch 2 "
                 "--tp 2 --pp 2 --dp 4 --cluster dgx-a100 --nodes 2").split()


def test_estimate_json_keys(capsys):
    assert estimate_main(ESTIMATE_ARGS + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "peak_memory_bytes",
                "time", "memory"):
        assert key in out
    assert set(out["time"]) >= {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "total_s"}
    assert out["time"]["total_s"] == pytest.approx(out["step_time_s"])
    assert 0 < out["mfu"] < 1 and out["peak_memory_bytes"] > 0
    assert out["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / out["step_time_s"] / 16)
    assert out["caveat"] == ""  # dgx-a100's efficiencies are its own
    args = list(ESTIMATE_ARGS)
    args[args.index("--cluster") + 1] = "dgx-h100"
    assert estimate_main(args + ["--json"]) == 0
    captured = capsys.readouterr()
    caveat = json.loads(captured.out)["caveat"]
    assert caveat.startswith("its GEMM efficiency and latency are its own") and caveat in captured.err


def test_estimate_table_and_llama_flags(capsys):
    args = ("--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --swiglu --seq 4096 "
            "--vocab 128256 --batch 256 --microbatch 1 --tp 4 --pp 2 --dp 2 --virtual-stages 2 "
            "--sequence-parallel --recompute selective --zero 1 --precision bf16 --cluster h200 --nodes 2").split()
    assert estimate_main(args) == 0
    out = capsys.readouterr().out
    for label in ("step time", "TFLOP/s per GPU", "MFU", "pipeline bubble", "data-parallel comm", "activations"):
        assert label in out


def test_estimate_rejects_bad_world_size_with_the_equation(capsys):
    args = list(ESTIMATE_ARGS)
    args[args.index("--nodes") + 1] = "3"
    assert estimate_main(args) == 2
    err = capsys.readouterr().err
    assert "tp(2) * pp(2) * dp(4) = 16 != nodes(3) * devices_per_node(8) = 24" in err


def test_estimate_warns_when_a_stage_does_not_fit(capsys):
    """GPT-3 175B without recomputation on 8-way tensor and 12-way pipeline
    parallelism and microbatch 4 needs more than 80 GB on its first stage: the
    estimate still prints, with the need and the capacity on stderr and in
    the table, and fits_in_memory false in JSON."""
    args = ("--layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 51200 --batch 1536 --microbatch 4 "
            "--tp 8 --pp 12 --dp 8 --cluster dgx-a100 --nodes 96").split()
    assert estimate_main(args + ["--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["fits_in_memory"] is False and out["peak_memory_bytes"] > out["memory_capacity_bytes"] == 80e9
    need = out["peak_memory_bytes"] / 2**30
    assert f"stage 0 needs {need:.2f} GiB per GPU, more than the 74.51 GiB a device of dgx-a100 has" in captured.err
    assert estimate_main(args + ["--recompute", "full"]) == 0
    captured = capsys.readouterr()
    assert "of 74.51 GiB\n" in captured.out and not captured.err


def test_estimate_on_part_of_a_node_and_nodes_by_default(capsys):
    """Four GPUs of an eight-GPU node: tensor parallelism stays on NVLink;
    --nodes defaults to what the GPUs fill; GPUs that neither fill whole
    nodes nor fit in one are refused with the count."""
    small = ("--layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --batch 64 --microbatch 2 "
             "--tp 4 --pp 1 --dp 1 --cluster dgx-a100 --json").split()
    assert estimate_main(small) == 0
    part = json.loads(capsys.readouterr().out)
    assert part["world_size"] == 4
    assert estimate_main(small + ["--nodes", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == part
    # the same tp = 4 across four one-GPU nodes pays InfiniBand instead
    model = TransformerConfig(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
    plan = TrainingPlan(batch=64, microbatch=2, tp=4)
    spread = estimate(model, plan, ONE_PER_NODE)
    assert spread.time.tp_comm_s > 5 * part["time"]["tp_comm_s"]
    assert estimate_main(ESTIMATE_ARGS[:-2] + ["--json"]) == 0  # 16 GPUs: 2 nodes without saying so
    assert json.loads(capsys.readouterr().out) == json.loads(
        (estimate_main(ESTIMATE_ARGS + ["--json"]), capsys.readouterr().out)[1])
    odd = small[:]
    odd[odd.index("--dp") + 1] = "3"  # 12 GPUs: one node and a half
    assert estimate_main(odd) == 2
    assert "= 12 GPUs do not fill whole nodes of devices_per_node(8)" in capsys.readouterr().err
    assert estimate_main(small + ["--nodes", "2"]) == 2
    assert "(a plan uses whole nodes, or part of one)" in capsys.readouterr().err


def _doc_commands(path: str, prefix: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) for each ``$ prefix ...``
    line of the console blocks in ``path``."""
    out, current = [], None
    for line in open(path).read().splitlines():
        if line.startswith("```"):
            current = None
        elif line.startswith("$ "):
            current = (line[2:], []) if line[2:].startswith(prefix) else None
            if current:
                out.append(current)
        elif current is not None:
            current[1].append(line.rstrip())
    return out


def test_estimate_examples_in_the_docs_are_what_it_prints(capsys):
    """Every `autopar estimate` example of docs/cli.md, run again, prints
    exactly the lines the page shows (stderr included, for the errors)."""
    examples = _doc_commands(os.path.join(REPO, "docs", "cli.md"), "autopar estimate ")
    assert len(examples) >= 3
    for command, shown in examples:
        estimate_main(command.split()[2:])
        captured = capsys.readouterr()
        printed = [line.rstrip() for line in (captured.err + captured.out).splitlines()]
        assert printed == shown, command


def test_estimate_rejects_unknown_cluster(capsys):
    args = list(ESTIMATE_ARGS)
    args[args.index("--cluster") + 1] = "nope"
    assert estimate_main(args) == 2
    assert "unknown cluster 'nope'" in capsys.readouterr().err
