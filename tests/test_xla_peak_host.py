"""XLA's TPU peak counts host memory: XlaMemory.total must leave it out and count HBM alone.

Numbers from Llama 3.1 405B on v5p-1024 (fsdp 512, each layer's input offloaded), XLA's memory
analysis and buffer assignment (docs/plans.md, "The largest models"): the peak is the arguments
plus the 63 GiB host block, larger than the 33.2 GiB block of HBM temporaries, where HBM holds
the arguments and that block, 42.06 GiB."""

from mxc.compiler.plan.plan import XlaMemory

GIB = 2**30


def test_a_peak_made_of_the_host_block_counts_hbm_alone():
    arguments = 9_512_521_216
    hbm_temporaries = 35_644_948_480
    host_block = 67_645_734_912
    memory = XlaMemory(parameters=3_170_729_600, optimizer_state=6_341_459_212, batch=332_404,
                       temporaries=hbm_temporaries, outputs=4_800, generated_code=37_732_864,
                       host_temporaries=host_block, peak=77_158_313_152)
    assert memory.parameters + memory.optimizer_state + memory.batch == arguments
    assert round(memory.total / GIB, 2) == 42.06  # not the raw peak's 71.86


def test_hbm_temporaries_above_the_host_block_count_whole():
    # MaxText's 405B setting: its HBM temporaries (83.36 GiB) exceed the host block (63.0).
    memory = XlaMemory(parameters=3_170_729_600, optimizer_state=6_341_459_212, batch=332_404,
                       temporaries=89_508_462_592, outputs=4_800, generated_code=42_142_208,
                       host_temporaries=67_645_734_912, peak=97_513_787_072)
    assert round(memory.total / GIB, 2) == 92.22
