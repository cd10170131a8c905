# The README's two commands: `make serve` and `make test` (and `make demo`).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DHEARTH_WERROR=ON

.PHONY: all setup build serve demo test clean

all: build

setup:
	@bash scripts/setup

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

serve: build
	@bash scripts/serve $(BUILD)

demo: build
	@bash scripts/demo $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

clean:
	rm -rf $(BUILD)
