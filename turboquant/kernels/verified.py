"""What was verified where, for each kernel back-end (Performance chapter; ``turboquant
kernels`` prints it)."""

__all__ = ["VERIFIED"]

VERIFIED = {
    "cpu": "turboquant/kernels/cpu.cpp compiled with g++ 12 (-O3 -march=native, OpenMP) on an "
           "AMD EPYC (AVX-512) and compared with the mx path (tests/test_cpu_kernels.py, also "
           "with its AVX2 and portable branches); its self-check runs on every machine first",
    "cpp": "the three kernel bodies compiled with g++ and run on this CPU, compared with the "
           "mx reference (tests/test_kernels.py, Chapter 11)",
    "cuda": "run on an NVIDIA H200 (mlx 0.32.4 with the mlx-cuda-13 wheel, 2026-12-04): the "
            "self-check passed and the kernels were adopted; encode, scores and values "
            "reproduce the mx path (encode against float32 on the CPU) for TurboQuant_mse at "
            "1, 3, 4, 5 and 8 bits and FibQuant with k = 2 and 4, D = 64 to 128 "
            "(tests/test_kernels.py); the CUDA translation unit compiles with nvcc 13 for "
            "sm_90; decode speed in Chapter 11 (book/results/gpu_check_h200.json)",
    "metal": "not compiled or run here: it needs an Apple GPU and the Metal compiler",
}
