#!/usr/bin/env bash
# Makes the git-ignored folders that bench/gpu-check.sh needs on the GPU
# machine (Ubuntu 24.04, no network, none of these packages installed) from
# Debian 12's packages: apt-get download, then dpkg -x, then what the build and
# the tests do not use (docs, man pages, static libraries) is removed. Run it on
# a Debian 12 machine whose apt lists are current (apt-get update), from the
# repository root or anywhere:
#   bash bench/gpu-deps.sh [FOLDER...]
# FOLDER is one or more of (default: all of them; each is made afresh):
#   grpc       .gpu/grpc: grpc++ 1.51, protobuf 3.21, protoc, grpc_cpp_plugin and
#              the libraries they load that Ubuntu 24.04 lacks under the same
#              soname (abseil, re2, c-ares); the build takes it with
#              -DHEARTH_GRPC_ROOT=.gpu/grpc and the binaries find the libraries
#              there through their RPATH
#   deps       .deps/root (libxxhash-dev: xxhash.h, for -DHEARTH_XXHASH_INCLUDE_DIR),
#              .deps/simdjson (libsimdjson-dev, libsimdjson14, for
#              -DHEARTH_SIMDJSON_ROOT) and .deps/text (libpcre2-dev, libutf8proc-dev,
#              for -DHEARTH_TEXT_DEPS_ROOT)
#   pyroot     .gpu/pyroot: flask, gunicorn and requests with what they import,
#              for the Python package's tests and bench/python/gunicorn_gpu.py
#              (pure Python but markupsafe, which falls back to Python where its
#              compiled speedups are for another interpreter)
#   webroot    .gpu/webroot: fastapi and uvicorn with what they import, for
#              examples/llm_uvicorn and bench/serve/generate_bench.py
#   baselines  .gpu/baselines: a copy of ../shared/baselines (or $SHARED/baselines),
#              the torch and safetensors baselines the benchmarks compare against
# Then carry .deps and .gpu to the GPU machine (their total size is printed
# last; the device tool carries 64 MiB at most) and run bench/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FOLDERS=${*:-grpc deps pyroot webroot baselines}
ARCH_DIR=usr/lib/x86_64-linux-gnu
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# unpack DEST PACKAGE...: DEST is replaced by the packages unpacked into it;
# DEST/PACKAGES lists the versions that went in.
unpack() {
  local dest=$1
  shift
  local debs=$WORK/debs-$(basename "$dest")
  mkdir -p "$debs"
  (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "$@" > /dev/null)
  rm -rf "$dest"
  mkdir -p "$dest"
  local deb
  for deb in "$debs"/*.deb; do
    dpkg -x "$deb" "$dest"
    dpkg-deb --show --showformat='${Package} ${Version}\n' "$deb" >> "$dest/PACKAGES"
  done
  # Nothing here reads documentation, man pages or lintian overrides.
  rm -rf "$dest/usr/share/doc" "$dest/usr/share/man" "$dest/usr/share/lintian"
  rmdir --ignore-fail-on-non-empty "$dest/usr/share" 2> /dev/null || true
}

make_grpc() {
  command -v objdump > /dev/null || { echo "gpu-deps: grpc needs objdump (binutils)" >&2; exit 1; }
  local dest=$ROOT/.gpu/grpc
  unpack "$dest" libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29 \
    libprotobuf-dev libprotobuf32 libprotoc32 protobuf-compiler protobuf-compiler-grpc \
    libabsl-dev libabsl20220623 libre2-9 libc-ares2
  local lib=$dest/$ARCH_DIR
  # The build links the shared libraries, named explicitly (no pkg-config, no
  # CMake package files: the .pc files name /usr and the -dev packages of
  # openssl and zlib), and runs protoc and grpc_cpp_plugin only.
  rm -rf "$lib/pkgconfig" "$lib/cmake" "$dest/usr/share" "$dest/usr/include/grpc++"
  find "$lib" -name '*.a' -delete
  rm -f "$lib"/libgrpc_unsecure.* "$lib"/libgrpc++_unsecure.* "$lib"/libgrpc++_alts.* \
    "$lib"/libgrpc++_error_details.* "$lib"/libgrpc++_reflection.* "$lib"/libgrpcpp_channelz.* \
    "$lib"/libprotobuf-lite.* "$dest"/usr/bin/grpc_{php,python,ruby}_plugin
  # Every library the remaining binaries need must be there or be one that
  # Ubuntu 24.04 has under the same soname (glibc, libstdc++, openssl 3, zlib).
  local system="ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libgcc_s.so.1 libstdc++.so.6 libssl.so.3 libcrypto.so.3 libz.so.1"
  local elf needed missing=""
  for elf in "$dest"/usr/bin/* "$lib"/*.so.*; do
    [ -L "$elf" ] && continue
    for needed in $(objdump -p "$elf" | awk '$1 == "NEEDED" {print $2}'); do
      case " $system " in *" $needed "*) continue ;; esac
      [ -e "$lib/$needed" ] || missing="$missing $(basename "$elf"):$needed"
    done
  done
  if [ -n "$missing" ]; then
    echo "gpu-deps: .gpu/grpc lacks libraries that its binaries need:$missing" >&2
    exit 1
  fi
}

make_deps() {
  unpack "$ROOT/.deps/root" libxxhash-dev
  find "$ROOT/.deps/root" -name '*.a' -delete
  unpack "$ROOT/.deps/simdjson" libsimdjson-dev libsimdjson14
  # backend: llm's tokenizer: PCRE2 (with its runtime, which the -dev
  # package's link points to) and utf8proc, for -DHEARTH_TEXT_DEPS_ROOT.
  unpack "$ROOT/.deps/text" libpcre2-dev libpcre2-8-0 libutf8proc-dev
  find "$ROOT/.deps/text" \( -name 'libpcre2-*.a' -o -name 'libpcre2-16*' -o -name 'libpcre2-32*' \
    -o -name 'libpcre2-posix*' \) -delete
}

make_pyroot() {
  unpack "$ROOT/.gpu/pyroot" python3-flask python3-werkzeug python3-jinja2 python3-markupsafe \
    python3-itsdangerous python3-click python3-blinker gunicorn python3-gunicorn python3-requests \
    python3-urllib3 python3-idna python3-certifi python3-chardet python3-charset-normalizer
}

make_webroot() {
  unpack "$ROOT/.gpu/webroot" python3-fastapi python3-starlette python3-pydantic python3-anyio \
    python3-sniffio python3-h11 python3-idna python3-uvicorn python3-asgiref python3-wsproto
}

make_baselines() {
  local from=${SHARED:-$ROOT/../shared}/baselines
  [ -d "$from" ] || { echo "gpu-deps: no $from (set SHARED to the folder that holds baselines/)" >&2; exit 1; }
  rm -rf "$ROOT/.gpu/baselines"
  mkdir -p "$ROOT/.gpu"
  cp -r "$from" "$ROOT/.gpu/baselines"
}

for folder in $FOLDERS; do
  case $folder in
    grpc | deps | pyroot | webroot | baselines) "make_$folder" ;;
    *) echo "gpu-deps: unknown folder '$folder' (grpc deps pyroot webroot baselines)" >&2; exit 2 ;;
  esac
  echo "gpu-deps: made $folder"
done
du -sh .gpu/* .deps/* 2> /dev/null || true
du -shc .gpu .deps 2> /dev/null | tail -1
