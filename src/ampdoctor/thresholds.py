"""Named thresholds shared by analysis, recommendations and rendering (ARCHITECTURE.md §2)."""

# Less than this many bits between a tensor's largest magnitude and the format's max is a warning.
HEADROOM_WARN_BITS = 1.0
# Headroom under this is "close" in renderings (colour bands), but no finding on its own.
HEADROOM_TIGHT_BITS = 4.0
# Verdict "underflow": at least this share of the reference's nonzero gradient values became zero.
UNDERFLOW_VERDICT_SHARE = 0.05
# Loss-scale window: a scale is "useless" when it loses at least this share of gradient values to zero.
SCALE_WINDOW_LOSS_SHARE = 0.01
# Binade histograms of gradients (loss-scale predictions): bins for 2**k, HIST_LOW <= k < HIST_HIGH, plus one bin
# below and one above (fp16's whole subnormal-to-max span is 40 bits; scales go up to 2**40).
HIST_LOW = -100
HIST_HIGH = 28
# Histograms by parameter name, and under this key (a prefix) the sum of those of gradients held in the low precision.
GRADIENT_KEY = "<gradient>"
# The default scale of torch.amp.GradScaler.
DEFAULT_FP16_SCALE = 2.0**16

# A remedy is verified only when the low-precision tensors on the fixed mechanism's path keep at least this many
# bits of headroom below the format's max after the fix (diagnose(..., margin_bits=...)); 1 bit is 2x.
MARGIN_BITS = 1.0
