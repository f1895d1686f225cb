"""The curated mutation set: bugs that would corrupt results without crashing, and the tests that must catch them.

Run with ``make mutate`` (tests/mutation/mutate.py); every mutation must be caught. Before resolving
an issue that touches one of these modules, run it and say the result in the note. When a refactor
moves a snippet, the run reports the mutation as stale: update its ``old`` text (and keep the bug).
"""

from __future__ import annotations

from tests.mutation.mutate import Edit, Mutation

_LOG2E = "1.4426950408889634"

MUTATIONS: tuple[Mutation, ...] = (
    # ------------------------------------------------------------------ KDA gate and kernels
    Mutation(
        "gate-exp",
        "the torch KDA gate (CPU training, every decode step) uses 1 + A_log for exp(A_log): equal at A_log = 0",
        (Edit("moelab/ops/kda/gate.py", "a = A_log.float().exp()[:, None]", "a = (1 + A_log.float())[:, None]"),),
        ("tests/model/test_kda_layer.py::test_gate_formulas_with_trained_like_parameters",
         "tests/model/test_kda_layer.py::test_prefill_and_decode_agree_with_trained_like_gate"),
    ),
    Mutation(
        "gate-dt-bias-dropped",
        "the torch KDA gate ignores dt_bias",
        (Edit("moelab/ops/kda/gate.py", "x = x + dt_bias.float().view(H, K)", "x = x"),),
        ("tests/model/test_kda_layer.py::test_gate_formulas_with_trained_like_parameters",),
    ),
    Mutation(
        "triton-gate-exp",
        "the Triton prep kernel's gate rate is 1 + A_log instead of exp(A_log)",
        (Edit("moelab/ops/kda/triton_prep.py", "a = tl.exp(tl.load(A_log + h).to(tl.float32))[:, None]",
              "a = (1.0 + tl.load(A_log + h).to(tl.float32))[:, None]", None),),
        ("tests/ops/test_kda_prep.py",),
    ),
    Mutation(
        "triton-log2e",
        "log2(e) rounded to 1.443 in the Triton chunk kernels (fp32 error ~3e-4 instead of ~1e-6)",
        tuple(Edit(f"moelab/ops/kda/{name}.py", _LOG2E, "1.443", None)
              for name in ("triton_common", "triton_fwd", "triton_prep")),
        ("tests/ops/test_kda_triton.py::test_matches_reference[B1T40H1K20V40C32-float32-h01-bounded]",
         "tests/ops/test_kda_triton.py::test_matches_reference[B1T40H1K20V40C32-float32-h01-general]"),
    ),
    Mutation(
        "kda-ref-decay-after-write",
        "the fp32 KDA reference decays the state after the delta-rule write instead of before",
        (Edit("moelab/ops/kda/naive.py", "        S = S * g[:, t].exp()[..., None]\n", ""),
         Edit("moelab/ops/kda/naive.py", "        S = S + k_t[..., None] * u[..., None, :]\n",
              "        S = S + k_t[..., None] * u[..., None, :]\n        S = S * g[:, t].exp()[..., None]\n")),
        ("tests/ops/test_kda_chunk.py",),
    ),
    # ------------------------------------------------------------------ router / top-k
    Mutation(
        "router-bias-in-weights",
        "the selection-only router bias enters the routing weights",
        (Edit("moelab/model/moe.py", "picked = scores.gather(1, idx)",
              "picked = (scores + self.bias).gather(1, idx)"),),
        ("tests/model/test_moe.py::test_router_bias_selects_but_does_not_weight",),
    ),
    Mutation(
        "topk-ignores-bias",
        "the torch top-k selects on the scores alone (the balancers' bias has no effect)",
        (Edit("moelab/ops/moe.py", "idx = torch.topk(scores + bias.float(), k, dim=-1).indices",
              "idx = torch.topk(scores, k, dim=-1).indices"),),
        ("tests/model/test_moe.py::test_router_bias_selects_but_does_not_weight",),
    ),
    Mutation(
        "router-normalizer-detached",
        "the routing weights' normalizer sum_T s carries no gradient (the router learns a wrong signal)",
        (Edit("moelab/model/moe.py", "weight = picked / picked.sum(-1, keepdim=True)",
              "weight = picked / picked.detach().sum(-1, keepdim=True)"),),
        ("tests/model/test_moe.py::test_moe_matches_dense_reference",),
    ),
    # ------------------------------------------------------------------ balancer rules
    Mutation(
        "loss-free-sign-flipped",
        "the loss-free balancer raises the bias of overloaded experts",
        (Edit("moelab/model/balance.py", "torch.sign(load.mean(-1, keepdim=True) - load)",
              "torch.sign(load - load.mean(-1, keepdim=True))"),),
        ("tests/model/test_balance.py",),
    ),
    Mutation(
        "quantile-load-flipped",
        "quantile_load moves the bias towards the overloaded experts",
        (Edit("moelab/model/balance.py", "recentre(bias + rate * (base - average))",
              "recentre(bias + rate * (average - base))"),),
        ("tests/model/test_balance.py",),
    ),
    Mutation(
        "qb-order-statistic-off-by-one",
        "exact quantile balancing takes the q-th instead of the (q+1)-th largest margin",
        (Edit("moelab/model/balance.py", "margins.kthvalue(m - q, dim=0)", "margins.kthvalue(m - q + 1, dim=0)"),),
        ("tests/model/test_balance.py",),
    ),
    Mutation(
        "qb-cutoff-kth",
        "the quantile-balancing cutoff is the k-th instead of the (k+1)-th largest biased score",
        (Edit("moelab/model/balance.py", "after = top.values[..., k:]", "after = top.values[..., k - 1:k]"),),
        ("tests/model/test_balance.py",),
    ),
    # ------------------------------------------------------------------ loss
    Mutation(
        "linear-ce-ignores-grad",
        "linear_ce's backward ignores its incoming gradient (wrong under gradient accumulation / loss scaling)",
        (Edit("moelab/ops/linear_ce.py", "return (dh * grad_loss).to(h_dtype), (dw * grad_loss).to(w_dtype),",
              "return dh.to(h_dtype), dw.to(w_dtype),"),),
        ("tests/ops/test_linear_ce.py",),
    ),
    Mutation(
        "linear-ce-mean-over-all",
        "linear_ce divides by every target, ignored ones included",
        (Edit("moelab/ops/linear_ce.py", "n = keep.sum()", "n = torch.tensor(targets.numel(), device=h.device)"),),
        ("tests/ops/test_linear_ce.py",),
    ),
    # ------------------------------------------------------------------ training loop: guard, resume
    Mutation(
        "nan-guard-loss-only",
        "the NaN guard checks train/loss only, not the gradient norm",
        (Edit("moelab/train/callbacks.py", "bad = [(k, v) for k, v in row.items() if not math.isfinite(v)]",
              "bad = [(k, v) for k, v in row.items() if k == 'train/loss' and not math.isfinite(v)]"),),
        ("tests/train/test_guard.py",),
    ),
    Mutation(
        "nan-guard-nan-only",
        "the NaN guard lets Inf through",
        (Edit("moelab/train/callbacks.py", "bad = [(k, v) for k, v in row.items() if not math.isfinite(v)]",
              "bad = [(k, v) for k, v in row.items() if math.isnan(v)]"),),
        ("tests/train/test_guard.py",),
    ),
    Mutation(
        "resume-offset",
        "a resumed run restarts the data one micro-step early (repeats a batch)",
        (Edit("moelab/data/datamodule.py", "start_step=step * accum)", "start_step=max(0, step * accum - 1))", None),),
        ("tests/train/test_fit.py::test_resume_after_ctrl_c_matches_an_uninterrupted_run",),
    ),
    # ------------------------------------------------------------------ AttnRes aggregation
    Mutation(
        "attnres-ref-softmax-dim",
        "the AttnRes torch reference normalizes over the width instead of over depth",
        (Edit("moelab/ops/attnres.py", "p = (keys @ query.float()).softmax(dim=0)",
              "p = (keys @ query.float()).softmax(dim=-1)"),),
        ("tests/ops/test_attnres_op.py",),
    ),
    Mutation(
        "attnres-ref-raw-keys",
        "the AttnRes torch reference scores the raw sources (no key RMSNorm)",
        (Edit("moelab/ops/attnres.py", "keys = F.rms_norm(v, (v.shape[-1],), norm_weight.float(), eps)",
              "keys = v * norm_weight.float()"),),
        ("tests/ops/test_attnres_op.py",),
    ),
    Mutation(
        "attnres-model-raw-keys",
        "the model's DepthAttention scores the raw sources (no key RMSNorm)",
        (Edit("moelab/model/attnres.py", "logits = self.key_norm(sources).float() @ self.query.float()",
              "logits = sources.float() @ self.query.float()"),),
        ("tests/model/test_attnres.py",),
    ),
    Mutation(
        "attnres-block-sum-dropped",
        "a block summary keeps only its last sublayer's output instead of their sum",
        (Edit("moelab/model/attnres.py", "self.sources.replace_last(self.sources.tensors[-1] + out)",
              "self.sources.replace_last(out)"),),
        ("tests/model/test_attnres.py",),
    ),
    # ------------------------------------------------------------------ packed documents, eval, studies, resume
    Mutation(
        "segments-eos-starts-document",
        "segments_from_eos puts each end-of-text token into the next document instead of the one it ends",
        (Edit("moelab/ops/varlen.py", "return (ends.cumsum(-1) - ends).to(torch.int32)",
              "return ends.cumsum(-1).to(torch.int32)"),),
        ("tests/data/test_document_boundaries.py::test_fixed_windows_segments_follow_the_stream_eos_positions",),
    ),
    Mutation(
        "packer-drops-eos",
        "the curriculum's document packer cuts each piece before its end-of-text token",
        (Edit("moelab/data/curriculum.py", "end = int(self.ends[self._document(pos)]) + 1",
              "end = int(self.ends[self._document(pos)])"),),
        ("tests/data/test_document_boundaries.py::test_packed_documents_start_only_after_an_eos",),
    ),
    Mutation(
        "qb-histogram-qth",
        "histogram quantile balancing takes the bin of the q-th instead of the (q+1)-th largest margin",
        (Edit("moelab/model/balance.py", "top_bin = (at_or_above > q).sum(-1) - 1",
              "top_bin = (at_or_above >= q).sum(-1) - 1"),),
        ("tests/train/test_qb_order_statistic.py",),
    ),
    Mutation(
        "passkey-token-accuracy",
        "passkey accuracy counts answer tokens instead of whole keys",
        (Edit("moelab/eval/tasks.py", "acc_row.append(score.correct.float().mean().item())",
              "acc_row.append((score.n_correct.sum() / score.n_tokens.sum()).item())"),),
        ("tests/eval/test_grid_scores.py::test_passkey_grid_scores_known_partial_answers",),
    ),
    Mutation(
        "arms-neighbours-only",
        "the arm check compares each arm with the next one only (first and last arms may be the same config)",
        (Edit("moelab/studies/common.py", "for b in names[i + 1:]:", "for b in names[i + 1:i + 2]:"),),
        ("tests/studies/test_arm_confounds.py::test_first_and_last_arm_resolve_to_the_same_config",),
    ),
    Mutation(
        "resume-keeps-old-betas",
        "a resume keeps the checkpoint's Adam betas instead of the config's",
        (Edit("moelab/train/module.py", "group.update(initial_lr=t.lr, weight_decay=decay, betas=t.betas)",
              "group.update(initial_lr=t.lr, weight_decay=decay)"),),
        ("tests/train/test_resume_groups.py",),
    ),
    Mutation(
        "failed-start-keeps-folder",
        "a run that fails before its first step keeps its folder (the name is then refused)",
        (Edit("moelab/train/runner.py",
              'if not (self.folder / "config.yaml").exists() and self.describe_run() is None:', "if False:"),),
        ("tests/train/test_data_check_failure.py::test_data_check_failure_leaves_no_folder_and_a_failed_run",),
    ),
    # ------------------------------------------------------------------ study reuse, token cache, curriculum plan,
    # ------------------------------------------------------------------ MQAR, curriculum resume, varlen, report
    Mutation(
        "grid-reuse-ignores-fingerprint",
        "the study grid reuses any finished record of an (arm, seed), even one made with another config or code",
        (Edit("moelab/studies/common.py",
              'if (data.get("format") not in READ_FORMATS or data.get("fingerprint") != fingerprint\n',
              'if (data.get("format") not in READ_FORMATS\n'),),
        ("tests/studies/test_grid_reuse.py",),
    ),
    Mutation(
        "corpus-manifest-top-level-only",
        "the token cache's manifest hashes only its top-level files: a damaged train/val stream is not rebuilt",
        (Edit("moelab/data/corpus.py", 'for p in sorted(tmp.rglob("*")) if p.is_file()',
              'for p in sorted(tmp.glob("*")) if p.is_file()'),),
        ("tests/data/test_corpus.py::test_corrupt_cache_is_rebuilt",),
    ),
    Mutation(
        "curriculum-tokens-per-micro-batch",
        "a curriculum stage's tokens count in micro-batches, not optimizer steps (accumulation multiplies its steps)",
        (Edit("moelab/data/curriculum.py", "steps = stage.tokens // step_tokens",
              "steps = stage.tokens // micro_tokens"),),
        ("tests/data/test_curriculum.py::test_plan_keeps_tokens_per_step_and_runs_the_last_stage_to_max_steps",),
    ),
    Mutation(
        "mqar-keys-with-replacement",
        "MQAR draws its keys with replacement: a repeated key has two values and its query two answers",
        (Edit("moelab/data/synthetic.py", "keys = np.argsort(rng.random((n, half - 1)), axis=1)[:, :num_pairs] + 1",
              "keys = rng.integers(1, half, size=(n, num_pairs))"),),
        ("tests/data/test_synthetic.py::test_mqar",),
    ),
    Mutation(
        "curriculum-resume-offset",
        "a resumed curriculum run restarts its data at the optimizer step instead of the micro-step (repeats batches)",
        (Edit("moelab/data/datamodule.py", "CurriculumSampler(stages, accum, rank, world, start_step=step * accum)",
              "CurriculumSampler(stages, accum, rank, world, start_step=step)"),),
        ("tests/data/test_curriculum.py::test_resume_mid_stage_gives_the_same_batches_and_ranks_do_not_overlap",),
    ),
    Mutation(
        "cu-seqlens-ends-at-T",
        "cu_seqlens closes the last document at T instead of B * T (right only for one row)",
        (Edit("moelab/ops/varlen.py", "offsets.new_tensor([starts.numel()])",
              "offsets.new_tensor([starts.shape[-1]])"),),
        ("tests/ops/test_varlen.py::test_cu_seqlens_gives_document_offsets_in_the_flattened_batch",),
    ),
    Mutation(
        "interval-population-sd",
        "the paired t interval uses the population standard deviation (ddof 0): too narrow with 3 seeds",
        (Edit("moelab/studies/report.py", "stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)",
              "stats.t.ppf(0.5 + level / 2, n - 1) * x.std() / math.sqrt(n)"),),
        ("tests/studies/test_report.py::test_paired_t_interval_matches_hand_computation",),
    ),
    Mutation(
        "welch-population-variance",
        "Welch's interval uses the population variances (ddof 0)",
        (Edit("moelab/studies/report.py", "vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)",
              "vx, vy = x.var() / len(x), y.var() / len(y)"),),
        ("tests/studies/test_report.py::test_welch_matches_hand_computation",),
    ),
    Mutation(
        "packed-prep-one-token-more",
        "the packed prep reads one token past each chunk's documents (the next document's first token leaks into the "
        "padding of a document's last chunk)",
        (Edit("moelab/ops/kda/triton_prep.py", "rows = r < tl.load(chunk_len + i_c)",
              "rows = r <= tl.load(chunk_len + i_c)"),),
        ("tests/ops/test_kda_prep.py::test_packed_prep_writes_the_documents_chunk_layout",),
    ),
    Mutation(
        "gated-norm-gate-derivative",
        "the fused gated RMSNorm's gate gradient drops the sigmoid's derivative factor (1 - sigmoid)",
        (Edit("moelab/ops/rms_norm.py", "sg * (1.0 - sg)).to(dgate.dtype.element_ty)",
              "sg).to(dgate.dtype.element_ty)"),),
        ("tests/ops/test_rms_norm.py::test_gated_matches_the_fp32_reference",),
    ),
    Mutation(
        "ce-kernel-stale-max",
        "the fused loss kernel's online logsumexp forgets to rescale the running sum when a block raises the max",
        (Edit("moelab/ops/linear_ce.py", "acc = acc * tl.exp(m - shift) + tl.exp(x - shift)",
              "acc = acc + tl.exp(x - shift)"),),
        ("tests/ops/test_linear_ce.py::test_triton_kernel_over_several_vocabulary_blocks",),
    ),
)
