"""The inference side: the speculative decoding loop, the hardware-aware scheduler, the SPS
profile and the realised-outcome calibration."""
