"""Link and device numbers from their datasheets and specifications: the one place picockpt takes them from.

Plain data: every number below is a ceiling the part is specified for, never a measurement (measured bus
bandwidths and model FLOP utilisations sit below them). Units:

    links      bytes/s in ONE direction (a copy to the host and one back run at the same time, each at this)
    memories   bytes/s of the GPU's HBM (reads and writes together, as the datasheets give it)
    compute    FLOP/s of dense BF16 Tensor Core math (no 2:4 structured sparsity)

The datasheets give links as both directions added together ("900 GB/s" for NVLink 4 is 450 GB/s each way)
and Tensor Core rates with sparsity (twice the dense rate); each constant says which figure it halves.
A model of a step (picockpt/planning/host_walk.py, the lessons) imports these, so no two places can disagree.
"""

# ---- between a GPU and its host --------------------------------------------------------------------------------
# PCIe: a lane moves one bit a transfer; PCIe 3.0 and later encode 128 bits of data in 130 on the wire (PCI-SIG's
# PCIe 4.0 and 5.0 base specifications). NVIDIA's datasheets give the raw signalling rate, both directions added:
# "PCIe Gen4: 64 GB/s" (A100) and "PCIe Gen5: 128 GB/s" (H100, H200), that is 2 x 16 lanes x 16 or 32 GT/s / 8,
# before the encoding takes its 2 bits in 130.
PCIE_GEN4_X16 = 16e9 * 16 * 128 / 130 / 8  # 31.5e9 bytes/s a direction: 16 GT/s a lane, 16 lanes, 128b/130b
PCIE_GEN5_X16 = 32e9 * 16 * 128 / 130 / 8  # 63.0e9 bytes/s a direction: 32 GT/s a lane, 16 lanes, 128b/130b

# NVLink-C2C, the chip-to-chip link of NVIDIA's superchips: 900 GB/s both directions added, between the Grace CPU
# and the Hopper GPU of a GH200 (NVIDIA's GH200 Grace Hopper Superchip datasheet), and per link between the Grace
# CPU and each Blackwell GPU of a GB200 (Transformer Engine's CPU-offloading docs,
# docs/features/other_optimizations/cpu_offloading/cpu_offloading.rst).
NVLINK_C2C = 900e9 / 2  # 450e9 bytes/s a direction, one link

# ---- between GPUs --------------------------------------------------------------------------------------------------
NVLINK_4 = 900e9 / 2  # 450e9 bytes/s a direction: "NVLink: 900 GB/s" (18 links, both directions added), NVIDIA's
#                       H100 SXM and H200 SXM datasheets
NVLINK_3 = 600e9 / 2  # 300e9 bytes/s a direction: "NVLink: 600 GB/s" (12 links, both directions added), NVIDIA's
#                       A100 SXM datasheet
INFINIBAND_NDR = 400e9 / 8  # 50e9 bytes/s a direction, one port: NDR InfiniBand carries 400 Gb/s a port
#                             (NVIDIA ConnectX-7 and Quantum-2 datasheets)
INFINIBAND_HDR = 200e9 / 8  # 25e9 bytes/s a direction, one port: HDR InfiniBand carries 200 Gb/s a port
#                             (NVIDIA ConnectX-6 and Quantum datasheets)

# ---- compute: dense BF16 Tensor Core peaks --------------------------------------------------------------------------
H100_SXM_BF16 = 1979e12 / 2  # 989.5e12 FLOP/s: NVIDIA's H100 datasheet, "BF16 Tensor Core 1,979 teraFLOPS" with
#                              sparsity (SXM); dense is half
H200_SXM_BF16 = 1979e12 / 2  # 989.5e12 FLOP/s: NVIDIA's H200 datasheet, the same 1,979 TFLOPS with sparsity: the
#                              same GH100 chip, its gain over the H100 is memory
A100_SXM_BF16 = 312e12  # FLOP/s: NVIDIA's A100 datasheet, "BFLOAT16 Tensor Core 312 TFLOPS" (624 with sparsity)

# ---- HBM bandwidth --------------------------------------------------------------------------------------------------
H100_SXM_HBM = 3.35e12  # bytes/s: NVIDIA's H100 datasheet, H100 SXM, 80 GB HBM3, "3.35 TB/s"
H200_SXM_HBM = 4.8e12  # bytes/s: NVIDIA's H200 datasheet, H200 SXM, 141 GB HBM3e, "4.8 TB/s"
A100_SXM_HBM = 2.039e12  # bytes/s: NVIDIA's A100 datasheet, A100 80 GB SXM, HBM2e, "2,039 GB/s"

# ---- memory capacity -------------------------------------------------------------------------------------------------
# The datasheets' "GB" of HBM counts binary gigabytes (GiB, 2**30 bytes), not 10**9 bytes: the driver of each reports
# more than the decimal figure (nvidia-smi's memory.total, NVML's: 81,559 MiB on an H100 SXM, 143,771 MiB on an H200,
# 81,920 MiB on an A100 80GB, as Modal tabulates them: thundergolfer.com/blog/nvidia-gpu-memory-capacity). That
# total, on the H100 and H200 a little below the datasheet's figure, is all a program can allocate; the CUDA context
# and NCCL's buffers come out of it too.
H100_SXM_GIB = 80  # NVIDIA's H100 datasheet, H100 SXM: "GPU memory 80GB"
H200_SXM_GIB = 141  # NVIDIA's H200 datasheet, H200 SXM: "GPU memory 141GB"
A100_SXM_GIB = 80  # NVIDIA's A100 datasheet, A100 80GB SXM: "GPU memory 80GB HBM2e"
H100_SXM_REPORTED = 81559 * 2**20  # bytes: the driver's total on an H100 SXM (79.65 GiB)
H200_SXM_REPORTED = 143771 * 2**20  # bytes: the driver's total on an H200 SXM (140.40 GiB)
A100_SXM_REPORTED = 81920 * 2**20  # bytes: the driver's total on an A100 80GB SXM (80.00 GiB: all of it)
