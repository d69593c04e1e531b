# fsdp.cpp — the two commands a newcomer runs are `make demo` and `make test`.
# Each one installs what it needs (idempotent), builds, and runs.

BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: all setup configure build test demo bench format clean

all: build

setup:
	@bash scripts/setup.sh

# FSDP_LIBTORCH=/path/to/libtorch (make variable or environment) builds against that libtorch
# 2.x instead of the torch wheel in .venv; setting it reconfigures.
FSDP_LIBTORCH ?=
CMAKE_ARGS ?=

# Compiler: clang++ (and clang) when installed, g++ otherwise. With clang the precompiled header
# also holds libtorch's template instantiations, so each file compiles 2-3x faster than with
# g++, which instantiates them again in every file (docs/building.md). `make test CXX=g++` (or
# CXX/CC in the environment, or -DCMAKE_CXX_COMPILER in CMAKE_ARGS) picks the compiler
# instead. It is fixed when $(BUILD_DIR) is first configured: `make clean` before switching.
ifneq ($(origin CXX),default)
  FSDP_COMPILERS := -DCMAKE_CXX_COMPILER="$(CXX)"
  ifneq ($(origin CC),default)
    FSDP_COMPILERS += -DCMAKE_C_COMPILER="$(CC)"
  endif
else ifeq ($(findstring CMAKE_CXX_COMPILER,$(CMAKE_ARGS)),)
  # Looked up by the shell when the configure recipe runs, after setup: on a fresh machine
  # clang is installed by setup, so a lookup while make reads this file would find none.
  FSDP_COMPILERS = $$(command -v clang++ >/dev/null && command -v clang >/dev/null && \
    echo -DCMAKE_CXX_COMPILER="$$(command -v clang++)" -DCMAKE_C_COMPILER="$$(command -v clang)")
endif

$(BUILD_DIR)/build.ninja: | setup
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	    -DFSDP_LIBTORCH="$(FSDP_LIBTORCH)" $(FSDP_COMPILERS) $(CMAKE_ARGS)

configure: setup $(BUILD_DIR)/build.ninja
ifneq ($(FSDP_LIBTORCH),)
	cmake -S . -B $(BUILD_DIR) -DFSDP_LIBTORCH="$(FSDP_LIBTORCH)" $(CMAKE_ARGS)
endif

build: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --repeat until-pass:2 $(CTEST_ARGS)

demo: build
	$(BUILD_DIR)/bin/fsdp-train --model gpt2-mini --vocab-size 128 --strategy fsdp --devices 2 \
	    --max-steps 80 --batch-size 8 --block-size 64 --lr 1e-3 $(DEMO_ARGS)

bench: build
	$(BUILD_DIR)/bin/fsdp-bench comm --json

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp')

clean:
	rm -rf $(BUILD_DIR)
