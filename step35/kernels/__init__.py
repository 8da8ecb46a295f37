"""The device-specific ops behind one interface, each module one concept; which kernel runs is
decided in them, by the device of the tensors, and nowhere else (the NPU calls themselves are in
step35.accelerators):
- grouped_gemm: the routed experts' grouped GEMM (`grouped_mm`);
- attention: causal attention with GQA, sliding windows, packed documents and context-parallel
  shares (`attention`);
- masks: which keys each query reads (`causal_mask`, `DocumentMask`, `PositionMask`, `SequenceShard`);
- sequence_split: the arithmetic of the context-parallel split of a sequence over cp ranks.
"""
