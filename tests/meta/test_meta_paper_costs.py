"""The seed papers' communication and parameter figures, recomputed by fedllm's own accounting on the
papers' models at their real shapes (meta device). docs/paper_costs.md explains every difference.

Expected values come from the papers' tables and formulas, never from fedllm: LLaMA-2-7B has 32 layers of
4096 x 4096 attention projections; Qwen2-0.5B 24 layers with q/o 896 x 896 and k/v 128 x 896.
"""

FRLORA = "recipes/frlora/llama2-7b-alpaca-gpt4-frlora.yaml"
FEDLORU = "recipes/fedloru/llama2-7b-alpaca-fedloru.yaml"
MFEDLORU = "recipes/fedloru/llama2-7b-alpaca-mfedloru.yaml"
FEDLORA_PFL = "recipes/personal/qwen2-0.5b-metamathqa-fedlora-pfl-full.yaml"
PFLMF = "recipes/personal/llama2-7b-fedaya-pflmf.yaml"
LLAMA_LAYERS, LLAMA_H = 32, 4096
LLAMA2_7B_PARAMS = 6_738_415_616  # the published parameter count of LLaMA-2-7B


def lora_params(rank, modules, layers=LLAMA_LAYERS, m=LLAMA_H, n=LLAMA_H):
    """r·(m + n) per wrapped m x n layer (seed 003 §F.3)."""
    return layers * modules * rank * (m + n)


def test_frlora_table_14_communication_per_round(meta_costs):
    """Seed 001 Table 14 (LLaMA-2-7B, r = 32, Alpaca-GPT4, 2 of 20 clients): Cost.P 8.388 x 2, Cost.NP 4.194 x 18,
    full fine-tuning 13476 x 2, Cost.T 92.26 "MB". The figures count parameters in millions (a participating
    client: down + up; an idle one: down), and the LoRA ones are a quarter of the r = 32 q/v adapter's count
    (docs/paper_costs.md; Table 9 shows the same quarter at r = 16)."""
    report = meta_costs(FRLORA)
    comm = report.comm
    adapter = lora_params(32, 2)  # 16,777,216: the recipe's r = 32 adapter on q_proj and v_proj
    assert report.trainable == adapter == 16_777_216
    assert set(comm.down.values()) == set(comm.up.values()) == {adapter * 4}  # fp32 (federation.comm_dtype)
    assert len(comm.down) == 2 and len(comm.idle_down) == 18
    assert set(comm.idle_down.values()) == {adapter * 4}  # idle clients receive (B̄, Ā) to apply ΔW too

    paper_count = {cid: (comm.down[cid] + comm.up[cid]) // 4 // 4 for cid in comm.down}  # parameters, / 4
    assert set(paper_count.values()) == {8_388_608}  # Cost.P: 8.388 (x 2 clients)
    assert {v // 4 // 4 for v in comm.idle_down.values()} == {4_194_304}  # Cost.NP: 4.194 (x 18 clients)
    full = comm.full_model_bytes // 4
    assert full == LLAMA2_7B_PARAMS and 2 * full // 10**6 == 13476  # full fine-tuning: every parameter, down + up
    idle_total = sum(comm.idle_down.values()) / 4 / 4 / 1e6
    assert abs(idle_total - 75.49) < 0.01  # "the additional overhead introduced by FRLoRA per round is 75.49 MB"
    assert abs(sum(paper_count.values()) / 1e6 + idle_total - 92.26) < 0.02  # Cost.T (the paper adds 16.77 + 75.49)


def test_frlora_table_9_parameter_counts(meta_costs):
    """Seed 001 Table 9 (r = 16, alpha = 32): RoBERTa-base 125.82M base, 1.77M trainable (LoRA on q, k, v and the
    attention output + the classifier head) — fedllm's counts exactly; LLaMA-2-7B 6738M base, 2.09M trainable —
    a quarter of the r = 16 q/v adapter (8,388,608)."""
    roberta = meta_costs("recipes/frlora/roberta-base-rte-frlora.yaml")
    lora = 12 * 4 * 16 * (768 + 768)
    head = 768 * 768 + 768 + 768 * 2 + 2  # classifier dense + out_proj (2 labels), trained as a copy
    assert roberta.trainable == lora + head == 1_771_778  # 1.77M
    assert int((roberta.frozen + lora) / 1e4) / 100 == 125.82  # base (with the frozen head) + LoRA factors
    llama = meta_costs(FRLORA, "lora.r=16", "lora.alpha=32")
    assert llama.frozen // 10**6 == 6738
    assert llama.trainable == lora_params(16, 2) == 4 * 2_097_152  # paper: 2.09M


def test_frlora_table_15_svd_is_reported_for_the_principal_init(meta_costs):
    report = meta_costs(FRLORA)
    assert report.svd is not None and report.svd.layers == 64 and report.svd.method == "randomized"
    q = 32 + 8  # rank + oversample probes, niter = 4: 2·niter + 2 passes of 2·m·n·q flops, plus QRs
    expected = 64 * (2 * LLAMA_H * LLAMA_H * q * 10 + 4 * (2 * LLAMA_H) * q * q)
    assert report.svd.flops == expected
    assert meta_costs(FEDLORU).svd is None  # FedLoRU has no SVD init


def test_fedloru_trainable_share_and_communication(meta_costs):
    """Seed 003 §D: 0.124 % trainable at rank 8 and 0.248 % at rank 16 (q, k, v, o; PEFT's count, trainable over
    all parameters); §F.3: r(m + n) parameters per layer instead of mn; cost = 2 x clients x participation x
    parameters x bytes per round."""
    r16, r8 = meta_costs(FEDLORU), meta_costs(FEDLORU, "lora.r=8", "lora.alpha=16")
    for report, rank, share in ((r8, 8, 0.124), (r16, 16, 0.248)):
        assert report.trainable == lora_params(rank, 4)
        assert report.frozen == LLAMA2_7B_PARAMS
        assert int(100_000 * report.trainable / (report.trainable + report.frozen)) / 1000 == share
    comm = r16.comm
    assert set(comm.up.values()) == set(comm.down.values()) == {lora_params(16, 4) * 4}
    assert comm.round_up + comm.round_down == 2 * 10 * 0.5 * lora_params(16, 4) * 4
    assert comm.full_model_bytes == LLAMA2_7B_PARAMS * 4  # FedAvg's mn per layer (and the rest of the model)


def test_mfedloru_nested_upload(meta_costs):
    """Seed 003 Alg. 3: a client of rank r_k < r sends r_A(m + r) + r_B(n + r) per layer (A_d A_u, B_d B_u) and
    receives the rank-r (A, B): r(m + n); a full-rank client sends (A, B)."""
    report = meta_costs(MFEDLORU, "federation.num_clients=4", "federation.strategy_args.client_ranks=[128,64,32,16]")
    comm, r = report.comm, 128
    assert comm.sampled == [0, 1]
    assert comm.down == {0: lora_params(r, 4) * 4, 1: lora_params(r, 4) * 4}
    nested = 4 * LLAMA_LAYERS * (64 * (LLAMA_H + r) + 64 * (LLAMA_H + r))
    assert comm.up == {0: lora_params(r, 4) * 4, 1: nested * 4}


def test_fedlora_pfl_sends_only_the_shared_part(meta_costs):
    """Seed 002 §3: clients upload the full-rank σ of each layer and keep the low-rank τ private."""
    report = meta_costs(FEDLORA_PFL)
    sigma = 24 * (2 * 896 * 896 + 2 * 128 * 896)  # q, o: 896 x 896; k, v: 128 x 896 (two KV heads of 64)
    assert set(report.comm.up.values()) == set(report.comm.down.values()) == {sigma * 4}
    assert not report.comm.idle_down
    assert report.state.client_entry > 0  # τ stays on the client


def test_pflmf_sends_a_gradient_the_size_of_u(meta_costs):
    """Seed 004 Alg. 1: the server sends U (d x r), a client sends G_i = ∇f_i(U v_i) v_iᵀ (d x r) and keeps v_i."""
    report = meta_costs(PFLMF)
    d, rank = lora_params(8, 2), 10  # θ: the rank-8 q/v LoRA factors of LLaMA-2-7B; U's rank 10
    assert set(report.comm.up.values()) == set(report.comm.down.values()) == {d * rank * 4}
    assert report.state.client_entry == rank * 4  # v_i: r floats
