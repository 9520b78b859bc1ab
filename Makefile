# sglang-tiered: one command to serve, one to test. Everything installs itself into .venv.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: env model serve demo test test-fast soak bench bench-family fleet-sim fleet-bench t2-bench redis clean

env:
	@bash scripts/setup_env.sh

model: env
	@$(PY) -m sglang_tiered.cli build-model

# MODEL=path serves another model; SGLANG_ARGS="..." passes extra launch_server flags.
serve: env
	@$(PY) -m sglang_tiered.cli serve $(if $(MODEL),--model $(MODEL)) $(if $(PORT),--port $(PORT)) -- $(SGLANG_ARGS)

# Stock SGLang vs sglang-tiered (+T1) on the same device pool, a seeded multi-tenant workload,
# outputs checked against a no-cache server; table + JSON/CSV/PNG under bench/results/.
demo: env
	@$(PY) bench/live_compare.py $(DEMO_ARGS)

# Trace replay (no model): tiered vs every SGLang eviction policy, Belady, infinite cache.
bench: env
	@$(PY) bench/trace_replay.py

# 200 generated workloads + Mooncake + multi-tenant, 6 capacities, every SGLang policy (~25 min, 2 cores).
bench-family: env
	@$(PY) bench/workload_family.py $(FAMILY_ARGS)

# Fleet simulator (no model): every routing policy over N = 1..44 simulated servers.
fleet-sim: env
	@$(PY) bench/fleet_sim.py $(FLEET_SIM_ARGS)

# Live loopback fleet: Redis + 3 tiered servers behind our router vs smg round_robin,
# cache_aware, prefix_hash; JSON/CSV/PNG under bench/results/. Not part of CI (about 10 min).
# FLEET_BENCH_ARGS="--threads 1 --server-cpus 0.5": fixed compute per server (cgroup quota, root).
fleet-bench: env redis
	@HF_HUB_OFFLINE=1 $(PY) bench/fleet_live.py $(FLEET_BENCH_ARGS)

# T2 on Mooncake Store: fleet hit rate with/without T2 under round robin + T2 vs raw Mooncake GB/s,
# in a loopback-only network namespace (needs root); JSON/CSV/PNG under bench/results/ (~5 min).
t2-bench: env
	@bash scripts/install_t2_deps.sh
	@$(PY) bench/t2_fleet.py $(T2_BENCH_ARGS)

# redis-server (Debian package) for the fleet tests and fleet-bench; needs root or sudo.
redis:
	@bash scripts/install_redis.sh

test: env
	@$(PY) -m pytest $(PYTEST_ARGS)

# The longer differential soak and HTTP fuzz (CI runs 500 / 1,000 requests of each), and the fuzz
# of sampling and logprob fields (not in CI).
soak: env
	@SGLANG_TIERED_SOAK_REQUESTS=$${SOAK_REQUESTS:-3000} SGLANG_TIERED_FUZZ_REQUESTS=$${FUZZ_REQUESTS:-5000} \
		SGLANG_TIERED_FUZZ_SAMPLING=$${FUZZ_SAMPLING:-3000} \
		$(PY) -m pytest -q tests/test_e2e_hardening.py $(PYTEST_ARGS)

# Unit and property tests only (no SGLang server processes; the fleet and T2 tests among them start a
# throwaway redis-server and mooncake_master on 127.0.0.1 where installed).
test-fast: env
	@$(PY) -m pytest -m "not server" $(PYTEST_ARGS)

clean:
	rm -rf .venv logs .pytest_cache .hypothesis
