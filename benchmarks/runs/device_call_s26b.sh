#!/bin/bash
# Twenty-sixth session, second call: the headline at HEAD (exact guidance with the fused
# forward; noise still drawn by the engine here, as pi05_gpu.py times it), and on an H200 the shared
# server at 64 robots. Same as s24d. Carry .whl.
exec bash benchmarks/runs/device_call_s24d.sh
