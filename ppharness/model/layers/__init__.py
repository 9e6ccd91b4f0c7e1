"""What the blocks are built of, on tinygrad: the projection over a weight format (``linear``), attention in every
shape a step asks for (``attention``), the llama-family block (``block``), batched rows (``rows``), mixture-of-experts
routing and combining (``moe``) and the kernel settings every process pins (``kernels``)."""
