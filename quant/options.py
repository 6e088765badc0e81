"""The values the quantization settings may take: one list, read by quant.export (which acts on them) and
by training.config (which checks a config before any run starts). No torch import, so loading a config
stays light."""
METHODS = ("gptq", "rtn")
SCHEMES = ("rd", "rank", "sdclip")
ERROR_WEIGHTS = ("output", "fisher")
MIN_BITS = (4, 5)               # scheme rank: 5: int5/int6 only; 4: int4 as the logged fallback when all-int5 is over
TABLE_BITS = (5, 6, 8)          # embedding tables: round-to-nearest per row at one of these widths
OBSERVED_BITS = (4, 5, 6, 8)    # matrices quantized on their observed inputs (the mHC phi projections)
CALIB_SOURCES = ("train", "generated")


def one_of(values: tuple) -> str:
    """'a', 'b' or 'c': the allowed values, for error messages."""
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
