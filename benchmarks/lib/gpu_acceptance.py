"""Issue 25's acceptance checks over `speed.py gpu`'s result, each PASS, FAIL or n/a (a figure the run did not
make: a peer absent, a row left out, no GPU), with the figures it compared. Never asserted: a report."""

from __future__ import annotations

PEAK_VS_ESTIMATE = 0.03      # NVML peak within 3% of the estimate
ROOFLINE_NONE_Q4 = 0.6       # none, Q4_K_M, batch 1: weight bytes per step / time over the memory roof
NONE_VS_LLAMA = 0.8          # ... and decode over llama.cpp fully offloaded
BATCH8_OVER_BATCH1 = 5.0     # tokens/s of batch 8 over batch 1 (none, Q4_K_M)
Q4_OVER_F16 = 2.5            # none decode, quantized over F16
STORED_BYTES = 0.02          # device bytes of the weights against their stored bytes
TRANSFER_BOUND = 1.15        # 25% and minimal: time per token over (bytes restored per token / bus rate)
F16_VS_ACCELERATE = 3.0      # F16 at 25%: decode over transformers + accelerate at 25%
Q4_VS_LLAMA_DECODE, Q4_VS_LLAMA_PREFILL = 1.0, 1.5   # Q4_K_M at 25% over llama.cpp with the layers that fit


def _row(result: dict, type_name: str, label: str, batch: int = 1) -> dict | None:
    for f in result["files"]:
        if f["type"] == type_name:
            return next((r for r in f["rows"] if r["label"] == label and r["batch"] == batch and "error" not in r), None)
    return None


def _peer(result: dict, name: str, label: str) -> dict | None:
    peer = result.get("peers", {}).get(name) or {}
    return next((r for r in peer.get("rows", []) if r["label"] == label and r.get("decode_tokens_per_s")), None)


def acceptance(result: dict) -> list[dict]:
    checks: list[dict] = []

    def check(number: int, what: str, value, ok: bool | None, goal: str, why: str | None = None) -> None:
        checks.append({"item": number, "check": what, "value": value, "goal": goal,
                       "verdict": "n/a" if ok is None else "PASS" if ok else "FAIL", **({"why": why} if why else {})})

    on_gpu = result["config"]["backend"] == "cuda"
    for f in result["files"]:
        if f.get("error"):
            check(1, f"{f['type']}: the file's run", f["error"][:200], False, "no error")
        for r in f["rows"]:
            name = f"{f['type']} {r['label']} batch {r['batch']}"
            if r.get("error"):
                check(1, f"{name}: the row ran", r["error"][:200], False, "no error")
                continue
            check(2, f"{name}: greedy tokens equal {r['tokens_compared_with']}'s", r["tokens_equal"], r["tokens_equal"],
                  "identical")
            nvml = r["nvml_peak_bytes"]
            check(2, f"{name}: NVML peak / estimate", r["peak_over_estimate"] if nvml else None,
                  abs(nvml / r["estimated_peak_bytes"] - 1) <= PEAK_VS_ESTIMATE if nvml else None,
                  f"within {PEAK_VS_ESTIMATE:.0%}")
            if r["budget_bytes"] is not None:
                within = nvml <= r["budget_bytes"] if nvml else None
                check(2, f"{name}: NVML peak within the budget", nvml, within, f"<= {r['budget_bytes']} B",
                      memory_where(r) if within is False else None)
            if r["label"] in ("25%", "minimal") and r["bytes_restored_per_step"]:
                ratio = r["decode_ms_per_step"] / r["transfer_bound_ms"]
                check(5, f"{name}: time per step / transfer bound", round(ratio, 3),
                      ratio <= TRANSFER_BOUND if on_gpu else None, f"<= {TRANSFER_BOUND}")
        if "device_over_stored" in f:
            check(4, f"{f['type']}: device weight bytes / stored bytes", f["device_over_stored"],
                  abs(f["device_over_stored"] - 1) <= STORED_BYTES, f"within {STORED_BYTES:.0%}")

    none_q4, none_q4_8, none_f16 = _row(result, "Q4_K_M", "none"), _row(result, "Q4_K_M", "none", 8), \
        _row(result, "F16", "none")
    if none_q4:
        check(3, "Q4_K_M none batch 1: roofline fraction", none_q4["roofline_fraction"],
              none_q4["roofline_fraction"] >= ROOFLINE_NONE_Q4 if on_gpu else None, f">= {ROOFLINE_NONE_Q4}")
        llama = _peer(result, "llama.cpp", "full")
        ratio = none_q4["decode_tokens_per_s"] / llama["decode_tokens_per_s"] if llama else None
        check(3, "Q4_K_M none batch 1: decode / llama.cpp fully offloaded", ratio,
              ratio >= NONE_VS_LLAMA if ratio and on_gpu else None, f">= {NONE_VS_LLAMA}")
        if none_q4_8:
            ratio = none_q4_8["decode_tokens_per_s"] / none_q4["decode_tokens_per_s"]
            check(3, "Q4_K_M none: batch 8 / batch 1 decode tokens/s", round(ratio, 3),
                  ratio >= BATCH8_OVER_BATCH1 if on_gpu else None, f">= {BATCH8_OVER_BATCH1}")
    if none_q4 and none_f16:
        ratio = none_q4["decode_tokens_per_s"] / none_f16["decode_tokens_per_s"]
        check(4, "none decode: Q4_K_M / F16", round(ratio, 3), ratio >= Q4_OVER_F16 if on_gpu else None,
              f">= {Q4_OVER_F16}")
    f16_25, hf_25 = _row(result, "F16", "25%"), _peer(result, "transformers", "25%")
    ratio = f16_25["decode_tokens_per_s"] / hf_25["decode_tokens_per_s"] if f16_25 and hf_25 else None
    check(6, "F16 25%: decode / transformers + accelerate at 25%", ratio,
          ratio >= F16_VS_ACCELERATE if ratio and on_gpu else None, f">= {F16_VS_ACCELERATE}")
    q4_25, llama_25 = _row(result, "Q4_K_M", "25%"), _peer(result, "llama.cpp", "25%")
    for what, key, goal in (("decode", "decode_tokens_per_s", Q4_VS_LLAMA_DECODE),
                            ("prefill", "prefill_tokens_per_s", Q4_VS_LLAMA_PREFILL)):
        ratio = q4_25[key] / llama_25[key] if q4_25 and llama_25 else None
        check(6, f"Q4_K_M 25%: {what} / llama.cpp with the layers that fit", ratio,
              ratio >= goal if ratio and on_gpu else None, f">= {goal}")
    return checks


def memory_where(row: dict) -> str | None:
    """Where a row's NVML peak went, part by part against the estimate's parts (speed_gpu.memory_parts), or
    None where the pool was not sampled: CuPy's pool (slots, output weights, workspace, expert slots), the
    store's device tier, and what NVML saw beyond both (the overhead's: context, libraries; and the decoder's
    scratch)."""
    m = row.get("memory")
    if not m or m.get("pool_peak_bytes") is None or not row.get("nvml_peak_bytes"):
        return None
    pool_parts = m["slots_bytes"] + m["fixed_bytes"] + m["workspace_bytes"] + m["expert_bytes"]
    beyond = row["nvml_peak_bytes"] - m["pool_peak_bytes"] - m["store_device_peak_bytes"]
    return (f"pool peak {m['pool_peak_bytes']} B against {pool_parts} B estimated; store peak "
            f"{m['store_device_peak_bytes']} B against {m['store_limit_bytes']} B; beyond both {beyond} B against "
            f"overhead + margin + decoder {m['overhead_bytes'] + m['margin_bytes'] + m.get('decoder_bytes', 0)} B")


def acceptance_lines(checks: list[dict]) -> list[str]:
    counts = {v: sum(c["verdict"] == v for c in checks) for v in ("PASS", "FAIL", "n/a")}
    lines = [f"  acceptance (issue 25): {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['n/a']} n/a"]
    shown = [c for c in checks if c["verdict"] == "FAIL" or (c["verdict"] == "n/a" and c["item"] != 2)]
    lines += [f"    [{c['item']}] {c['verdict']:4s} {c['check']}: {c['value']} (goal {c['goal']})"
              + (f"; {c['why']}" if c.get("why") else "") for c in shown[:40]]
    return lines
