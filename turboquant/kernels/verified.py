"""What was verified where, for each kernel back-end (Performance chapter; ``turboquant
kernels`` prints it)."""

__all__ = ["VERIFIED"]

VERIFIED = {
    "cpu": "turboquant/kernels/cpu.cpp compiled with g++ 12 (-O3 -march=native, OpenMP) on an "
           "AMD EPYC (AVX-512) and compared with the mx path (tests/test_cpu_kernels.py, also "
           "with its AVX2 and portable branches); its self-check runs on every machine first",
    "cpp": "the three kernel bodies compiled with g++ and run on this CPU, compared with the "
           "mx reference (tests/test_kernels.py, Chapter 11)",
    "cuda": "the CUDA translation unit in mlx 0.32's generated layout compiled with nvcc 13 "
            "for sm_90 (tests/test_kernels.py, with a stand-in for mlx's device header; once by "
            "hand with the headers of the mlx-cuda-13 0.32.4 wheel); not run on an NVIDIA "
            "GPU",
    "metal": "not compiled or run here: it needs an Apple GPU and the Metal compiler",
}
