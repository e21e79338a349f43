# The README's two commands: `make run` (the main job) and `make test` (the tests).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test install dev deps model clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

install: $(VENV)/.installed

# tests also exercise the training path (tokenizer and logits parity), so they install the [train] extra
$(VENV)/.dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,train]'
	touch $@

dev: $(VENV)/.dev

# System packages the tests use (a real broker, a throwaway PostgreSQL, headless Chromium, and for the emulated
# ARM tests Debian's cross compilers with their libc and libgomp plus qemu-user), installed when missing with one
# apt-get update for all of them. Add a package to the list, not a target.
APT_PACKAGES := mosquitto postgresql chromium qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
                gcc-arm-linux-gnueabihf libc6-dev-armhf-cross

deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing:" $$missing; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; \
	fi

run: install
	$(VENV)/bin/edgetune probe
	$(VENV)/bin/edgetune tune
	$(VENV)/bin/edgetune report

# `$(PY) -m pytest -q -m slow` runs the long emulated sweep (a seeded sample of every workload's ARM space)
test: dev deps
	$(PY) -m pytest -q

# reproduce quantized_models/ from the committed data (about 50 s on 2 cores)
model: $(VENV)/.dev
	$(PY) -m tuner.train

clean:
	rm -rf $(VENV) build *.egg-info
