# The README's two commands: `make serve` and `make test` (and `make demo`).
BUILD ?= build
FUZZ_SECONDS ?= 20
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DHEARTH_WERROR=ON

.PHONY: all setup build serve demo test fuzz windows image clean

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
	@bash scripts/fuzz $(BUILD)-fuzz

# The libFuzzer targets (clang, their own build folder), each for FUZZ_SECONDS.
fuzz: setup
	@bash scripts/fuzz $(BUILD)-fuzz $(FUZZ_SECONDS)

# The Windows cross build and its tests under Wine (docs/windows.md); needs
# g++-mingw-w64-x86-64-posix, wine and wine64 (scripts/setup-windows).
windows:
	@bash scripts/setup-windows
	cmake -S . -B $(BUILD)-windows -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/cmake/mingw-w64.cmake
	cmake --build $(BUILD)-windows -j $(JOBS)
	cd $(BUILD)-windows && ctest --output-on-failure --timeout 300

# The CPU container image (docs/deploy.md), built without a container daemon:
# its root filesystem from Debian packages (mmdebstrap), the OCI layout and
# archive (umoci) in $(BUILD)/image/; scripts/setup-image installs both.
image: build
	@bash scripts/setup-image
	@bash scripts/image $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz $(BUILD)-windows
