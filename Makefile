# moelua - build, test, run. `make test` and `make run` install what is
# missing (make deps), build and go; see README.md.

CC      ?= cc
NVCC    ?= /usr/local/cuda/bin/nvcc
LUA_INC := /usr/include/lua5.4
LUA_A   := /usr/lib/x86_64-linux-gnu/liblua5.4.a

# No -ffast-math anywhere; no FMA contraction, so our own kernels' summation
# order is the one the source says (DESIGN.md, Numerics).
CFLAGS  ?= -O2 -g
override CFLAGS += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fopenmp \
           -ffp-contract=off -I$(LUA_INC) -MMD -MP
# Static Lua with the API exported (-Wl,-E): busted's C modules (lfs,
# term, system) resolve lua_* against the host.
LDLIBS  := -Wl,-E $(LUA_A) -lopenblas -ldnnl -lreadline -lcrypto -lm -ldl -fopenmp -pthread
# MPICH for the collectives (host/runtime/comm.c); it is called only under
# mpiexec, so a plain ./moelua never starts MPI.
override CFLAGS += $(shell pkg-config --cflags mpich 2>/dev/null)
LDLIBS  += $(shell pkg-config --libs mpich 2>/dev/null)

# backend_cuda.c and comm_nccl.c (NCCL for CUDA tensors) only in CUDA builds
CUDA_HOST   := host/runtime/backend_cuda.c host/runtime/comm_nccl.c
HOST_SRC    := $(filter-out $(CUDA_HOST),$(wildcard host/runtime/*.c host/bindings/*.c))
KERNEL_SRC  := $(wildcard kernels/*.c)
CUDA_SRC    := $(wildcard kernels/*.cu)
SRC         := $(HOST_SRC) $(KERNEL_SRC)

ifeq ($(CUDA),1)
BUILD   := build/cuda
TARGET  := build/cuda/moelua
override CFLAGS += -DML_WITH_CUDA -I/usr/local/cuda/include
SRC     += $(CUDA_HOST)
# sm_80 (A100 and every 8.x) and sm_90 (H100/H200) binaries, plus compute_90
# PTX that newer GPUs compile at load; backend_cuda.c refuses older ones.
NVFLAGS := -O2 -std=c++17 -DML_WITH_CUDA --fmad=false \
           -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
           -gencode arch=compute_90,code=compute_90
# .cu objects get their own suffix: kernels/x.c and kernels/x.cu share a stem.
CUDA_OBJ := $(CUDA_SRC:%.cu=$(BUILD)/%.cu.o)
# cudart static; cuBLAS is dlopen'ed on the first matmul (kernels/matmul.cu)
# and NCCL when a communicator needs it (host/runtime/comm_nccl.c): the
# binary starts without them and the bundle does not carry their 600 MB.
LDLIBS  += -L/usr/local/cuda/lib64 -lcudart_static -lrt -lpthread -ldl -lstdc++
else ifeq ($(SANITIZE),1)
BUILD   := build/asan
TARGET  := build/asan/moelua
override CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer
LDLIBS  += -fsanitize=address,undefined
else
BUILD   := build/cpu
TARGET  := moelua
endif

OBJ := $(SRC:%.c=$(BUILD)/%.o) $(CUDA_OBJ)

# The kernels at -O3: GCC 12's -O2 vectorises only the loops that need no
# run-time check (its "very cheap" cost model). -O3 changes no result (no
# reassociation without -ffast-math, no contraction: bitwise the same
# outputs, BENCHMARKS.md) and makes the training step 1.02-1.05x faster.
# One exception met so far: GCC 12.2's SLP vectorizer at -O3 dropped a
# (double)(float) rounding inside an unrolled block loop (kernels/router.c
# rounds in a loop of its own; router_spec checks the bits).
# -fno-math-errno: no kernel reads errno, and without it a loop calling
# sqrt does not vectorise (AdamW's); sqrtps rounds exactly as sqrtss does.
KERNEL_OPT ?= -O3
$(KERNEL_SRC:%.c=$(BUILD)/%.o): override CFLAGS += $(KERNEL_OPT) -fno-math-errno

DEB_PKGS := liblua5.4-dev lua5.4 lua-busted libopenblas-dev libdnnl-dev libreadline-dev \
            mpich libmpich-dev pkg-config libssl-dev lua-dkjson
BENCH_PKGS := python3 python3-torch python3-numpy libblis-dev libxsmm-dev

.PHONY: all deps bench-deps test run sanitize gpu-bundle clean
all: $(TARGET)

$(TARGET): $(OBJ)
	$(CC) -o $@ $(OBJ) $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unused-parameter -MMD -MP -MF $(@:.o=.d) -c $< -o $@

-include $(OBJ:.o=.d)

# Installs only what is missing, so a ready machine pays one dpkg query.
deps:
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

bench-deps: deps
	@missing=$$(for p in $(BENCH_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# With the CUDA build present (make CUDA=1; CI builds it first) the GPU
# specs also run on the emulated CUDA build (tests/run.sh, EMU_GPU).
test: deps
	$(MAKE) all
	$(MAKE) build/tests
	MOELUA=./$(TARGET) TEST_BUILD=$(BUILD) EMU_GPU=$(if $(wildcard build/cuda/moelua),1,) tests/run.sh

# A new run directory each time: a run directory that holds a run is
# refused (moelua.train), so `make run` twice never touches the first run.
run: deps
	$(MAKE) all
	./$(TARGET) recipes/longctx.lua --run-dir runs/longctx-$$(date +%Y%m%d-%H%M%S)

# C unit tests: each tests/c/test_*.c links against the host objects.
TEST_SRC := $(wildcard tests/c/test_*.c)
TEST_BIN := $(TEST_SRC:tests/c/%.c=$(BUILD)/tests/%)
LIB_OBJ  := $(filter-out $(BUILD)/host/bindings/main.o $(BUILD)/host/bindings/repl.o,$(OBJ))
.PHONY: build/tests
build/tests: $(TEST_BIN)
$(BUILD)/tests/%: tests/c/%.c $(LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Ihost/runtime -Ihost/bindings -o $@ $< $(LIB_OBJ) $(LDLIBS)

# ASan + UBSan over the whole suite (CI runs it too).
# UBSan only prints unless told to halt, and run.sh keeps no passing log,
# so halt_on_error makes undefined behaviour fail its suite. Child
# processes the specs start inherit these settings.
sanitize: deps
	$(MAKE) SANITIZE=1 all
	$(MAKE) SANITIZE=1 build/tests
	ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=tests/lsan.supp:print_suppressions=0 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  MOELUA=./build/asan/moelua TEST_BUILD=build/asan tests/run.sh

gpu-bundle:
	$(MAKE) CUDA=1 all
	tests/gpu/bundle.sh

clean:
	rm -rf build gpu-bundle moelua
