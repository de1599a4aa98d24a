"""bf16/fp16 products on a CPU without a half GEMM, in fp32 blocks (fedllm.models.cpu_half_matmul): the results a
native half GEMM gives (fp32 sums, one rounding), blocks within their bound, and a bf16 step that trains the same."""

import pytest
import torch
import torch.nn.functional as F

from fedllm.engine.client import train_client
from fedllm.models import cpu_half_matmul
from fedllm.models.cpu_half_matmul import Fp32HalfMatmuls, blocked_mm, model_dtypes, wanted


@pytest.fixture
def no_half_gemm(monkeypatch):
    """This CPU, whatever it has, as one without oneDNN's bf16/fp16 GEMM (an AVX2 x86)."""
    monkeypatch.setattr(cpu_half_matmul, "native_half_gemm", lambda dtype: False)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of at most 96 fp32 values and inner chunks of 8: every loop of blocked_mm on small shapes."""
    monkeypatch.setattr(cpu_half_matmul, "BLOCK_FLOATS", 96)
    monkeypatch.setattr(cpu_half_matmul, "INNER_CHUNK", 8)


def rounded_once(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp64 product rounded to ``dtype`` once: a half GEMM's result up to its fp32 sums."""
    return exact.to(dtype)


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of ``want``'s last place (its dtype's spacing at each value)."""
    spacing = torch.finfo(want.dtype).eps * want.double().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return float(((got.double() - want.double()).abs() / spacing).max())


def test_integer_products_are_exact_through_every_block(small_blocks):
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-3, 4, (13, 21), generator=gen).to(torch.bfloat16)
    b = torch.randint(-3, 4, (21, 17), generator=gen).to(torch.bfloat16)
    bias = torch.randint(-3, 4, (17,), generator=gen).to(torch.bfloat16)
    out = torch.empty(13, 17, dtype=torch.bfloat16)
    blocked_mm(a, b, out, bias.expand(13, 17))
    # |sums| <= 21 * 9 + 3 < 256: every partial sum and the result are integers bf16 holds exactly
    want = a.double() @ b.double() + bias.double()
    assert torch.equal(out.double(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(13, 21, 17), (1, 200, 3), (40, 5, 90)])
def test_blocked_products_equal_one_rounding_of_the_exact_product(small_blocks, dtype, shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    out = blocked_mm(a, b, torch.empty(m, n, dtype=dtype))
    want = rounded_once(a.double() @ b.double(), dtype)
    # fp32 sums of <= 200 exact products lose far less than half a half-precision ulp: at most one ulp apart
    assert ulps(out, want) <= 1.0


def test_blocks_stay_within_their_bound(small_blocks, monkeypatch):
    seen = []
    mm = torch.mm

    def spy(x, y):
        seen.append((x.numel(), y.numel(), x.shape[0] * y.shape[1]))
        return mm(x, y)

    monkeypatch.setattr(torch, "mm", spy)
    a, b = torch.randn(30, 50).bfloat16(), torch.randn(50, 40).bfloat16()
    blocked_mm(a, b, torch.empty(30, 40, dtype=torch.bfloat16))
    assert seen and all(max(x) <= 96 for x in seen)
    assert cpu_half_matmul.transient_bytes() == 3 * 4 * cpu_half_matmul.BLOCK_FLOATS


def test_the_mode_computes_every_half_product_and_passes_the_rest(no_half_gemm, small_blocks):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 24, generator=gen).bfloat16()
    w, bias = torch.randn(16, 24, generator=gen).bfloat16(), torch.randn(16, generator=gen).bfloat16()
    q, k = torch.randn(3, 7, 12, generator=gen).bfloat16(), torch.randn(3, 12, 9, generator=gen).bfloat16()
    c = torch.randn(3, 7, 9, generator=gen).bfloat16()
    x32, w32 = torch.randn(4, 24, generator=gen), torch.randn(16, 24, generator=gen)
    with Fp32HalfMatmuls():
        into = torch.empty(24, 9, dtype=torch.bfloat16)
        got = {"addmm": F.linear(x, w, bias), "mm": F.linear(x, w), "bmm": q @ k,
               "baddbmm": torch.baddbmm(c, q, k), "fp32": F.linear(x32, w32),
               "mm.out": torch.mm(w.T, k[0, :, :9].repeat(2, 1)[:16], out=into)}
        assert got["mm.out"] is into  # written where it was asked (the fused head loss's input gradient)
    want = {"addmm": x.double() @ w.double().T + bias.double(), "mm": x.double() @ w.double().T,
            "mm.out": w.double().T @ k[0, :, :9].repeat(2, 1)[:16].double(),
            "bmm": q.double() @ k.double(), "baddbmm": c.double() + q.double() @ k.double()}
    for name, exact in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert ulps(got[name], rounded_once(exact, torch.bfloat16)) <= 1.0, name
    assert torch.equal(got["fp32"], F.linear(x32, w32))  # not a half product: torch's own kernel, bit for bit


def test_gradients_through_the_mode_equal_one_rounding(no_half_gemm, small_blocks):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 24, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(16, 24, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(6, 16, generator=gen).bfloat16()
    with Fp32HalfMatmuls():
        F.linear(x, w).backward(g)
    assert ulps(x.grad, rounded_once(g.double() @ w.detach().double(), torch.bfloat16)) <= 1.0
    assert ulps(w.grad, rounded_once(g.double().T @ x.detach().double(), torch.bfloat16)) <= 1.0


def test_only_a_cpu_without_the_gemm_and_a_half_step_enter_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_half_matmul, "native_half_gemm", lambda dtype: False)
    assert wanted(cpu, {torch.float32, torch.bfloat16})
    assert not wanted(cpu, {torch.float32})  # an fp32 step: nothing entered
    assert not wanted(torch.device("meta"), {torch.bfloat16})
    monkeypatch.setattr(cpu_half_matmul, "native_half_gemm", lambda dtype: True)
    assert not wanted(cpu, {torch.bfloat16})  # oneDNN's GEMM: torch's kernels


def test_a_compiled_function_compiles_and_its_products_run_in_blocks(no_half_gemm, small_blocks, monkeypatch):
    """train.compile under the mode: dynamo still compiles (a dispatch mode would otherwise make it run the frame
    eagerly), and the graph's products reach the mode as they run."""
    from torch._dynamo.utils import counters

    seen = []
    dispatch = Fp32HalfMatmuls.__torch_dispatch__
    monkeypatch.setattr(Fp32HalfMatmuls, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: seen.append(func) or
                        dispatch(self, func, types, args, kwargs))
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda a, b: (a @ b).relu(), backend="eager")
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(12, 20, generator=gen).bfloat16(), torch.randn(20, 10, generator=gen).bfloat16()
    with Fp32HalfMatmuls():
        got = f(a, b)
    assert counters["frames"]["ok"] == 1 and torch.ops.aten.mm.default in seen
    assert ulps(got, rounded_once((a.double() @ b.double()).relu(), torch.bfloat16)) <= 1.0
    torch._dynamo.reset()


def test_a_quantised_layers_compute_dtype_counts():
    layer = torch.nn.Linear(4, 4)
    layer.compute_dtype = torch.bfloat16  # as bitsandbytes' Linear4bit holds it
    assert model_dtypes(torch.nn.Sequential(layer), "fp32") == {torch.float32, torch.bfloat16}


def test_a_bf16_client_trains_the_same_in_fp32_blocks(tiny_recipe, no_half_gemm, monkeypatch):
    """A tiny LLaMA with a bf16 base under bf16 autocast: one client's steps with the products in fp32 blocks and
    with torch's own kernels (the mode kept out) give the same loss and factors up to bf16 rounding."""
    from fedllm.data.collate import collate
    from fedllm.engine.server import build_federation
    from fedllm.models.loading import read_state
    from fedllm.recipe.checks import parse_recipe

    # plain SGD: an update is the gradient times the rate (AdamW would turn a rounding of a near-zero gradient into
    # a whole step of the rate)
    fed = build_federation(parse_recipe(tiny_recipe(train={"dtype": "bf16", "optimizer": "sgd", "lr": 0.5},
                                                    model={"name": "tiny-llama", "dtype": "bf16"})))
    model, strategy = fed.loaded.model, fed.strategy
    start = read_state(model, fed.global_keys)
    entered = []
    dispatch = Fp32HalfMatmuls.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        entered.append(func)
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(Fp32HalfMatmuls, "__torch_dispatch__", counting)
    results = {}
    for blocks in (True, False):
        monkeypatch.setattr(cpu_half_matmul, "ENABLED", blocks)
        plan = strategy.configure_client(1, 0, start)
        plan.lr = 0.5
        results[blocks] = train_client(model, plan, strategy, fed.data.examples, fed.data.clients[0], fed.recipe.train,
                                       lambda items: collate(items, fed.loaded.tokenizer.pad_token_id), seed=3)
        assert (torch.ops.aten.mm.default in entered) == blocks
        entered.clear()
    fast, reference = results[True], results[False]
    assert abs(fast.loss - reference.loss) <= 1e-2 * abs(reference.loss)
    moved = torch.cat([(reference.state[k] - start[k]).flatten() for k in start]).norm()
    apart = torch.cat([(fast.state[k] - reference.state[k]).flatten() for k in start]).norm()
    assert moved > 0 and apart <= 0.02 * moved  # bf16 roundings apart, not a different step


def test_the_bench_prints_both_kernels_side_by_side(capsys, monkeypatch, tmp_path):
    import json

    from tests.conftest import load_script

    bench = load_script("bench/cpu_half_matmul.py")
    monkeypatch.setattr(bench, "SHAPES", [(8, 48, 24)])
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--trials", "1", "--threads", "1", "--json", str(tmp_path / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "8x48x24" in out and "g @ W" in out and "x @ W.T" in out
    found = json.loads((tmp_path / "out.json").read_text())
    assert set(found["apart"]) == {"8x48x24 x @ W.T", "8x48x24 g @ W"}
    assert all(diff <= 1.0 and equal > 0.9 for diff, equal in found["apart"].values())  # fp32 sums rounded once
    assert all(len(v) == 1 and v[0] > 0 for v in found["gflops"].values())
