// `hearth bench --transport grpc`: the load of load_generator.h over
// inference.GRPCInferenceService (proto/grpc_service.proto): metadata from
// ModelMetadata and ModelConfig, regions through SystemSharedMemoryRegister
// and SystemSharedMemoryUnregister (CudaSharedMemoryRegister and
// CudaSharedMemoryUnregister for CUDA regions), requests as ModelInfer on grpc++'s
// callback API (inputs in raw_input_contents, or named in shared memory).
// Built only with gRPC (HEARTH_HAVE_GRPC).
#pragma once

#include <cstdio>
#include <memory>

#include "hearth/status.h"
#include "loadgen/bench_common.h"
#include "loadgen/load_generator.h"

namespace hearth::bench {

// RunBench's gRPC half, options already checked; fills what RunBench does
// not (mode, protocol, concurrency, the record's numbers).
Result<BenchReport> RunGrpcBench(const BenchOptions& options, std::FILE* err);

// MakeRegionControl's gRPC half: a channel of its own to options.url.
Result<std::unique_ptr<RegionControl>> MakeGrpcRegionControl(const BenchOptions& options);

}  // namespace hearth::bench
