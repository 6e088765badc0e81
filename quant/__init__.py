"""Post-training quantization and the artifact format.

Modules: calibrate (Hessians, self-generated calibration text), gptq (GPTQ and round-to-nearest),
allocate (int5/int6 split under a byte budget), pack (code layouts), container (the artifact file),
size (artifact + code byte accounting), export (the one entry point the trainer calls).

Kept empty on purpose: loading an artifact imports only quant.container and quant.pack, so scoring one
needs this file and those two of quant/.
"""
