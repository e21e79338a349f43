# The README's two commands: `make run` (the main job) and `make test` (the tests).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test install dev mosquitto cross model clean

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

mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q mosquitto; }

# the emulated ARM tests: Debian's cross compilers (with their libc and libgomp) and qemu-user, as tool:packages
CROSS_TOOLS := aarch64-linux-gnu-gcc:gcc-aarch64-linux-gnu,libc6-dev-arm64-cross \
               arm-linux-gnueabihf-gcc:gcc-arm-linux-gnueabihf,libc6-dev-armhf-cross \
               qemu-aarch64:qemu-user qemu-arm:qemu-user
cross:
	@missing=""; for tp in $(CROSS_TOOLS); do command -v $${tp%%:*} >/dev/null 2>&1 || missing="$$missing $${tp#*:}"; done; \
	if [ -n "$$missing" ]; then $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$(echo $$missing | tr , ' '); fi

run: install
	$(VENV)/bin/edgetune probe
	$(VENV)/bin/edgetune tune
	$(VENV)/bin/edgetune report

# `$(PY) -m pytest -q -m slow` runs the long emulated sweep (a seeded sample of every workload's ARM space)
test: dev mosquitto cross
	$(PY) -m pytest -q

# reproduce quantized_models/ from the committed data (about 50 s on 2 cores)
model: $(VENV)/.dev
	$(PY) -m tuner.train

clean:
	rm -rf $(VENV) build *.egg-info
