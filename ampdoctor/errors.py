"""The one exception type ampdoctor raises."""


class AmpDoctorError(RuntimeError):
    """A diagnosis could not be made; the message names the bad value and what to do about it.

    When it wraps an exception from the user's model or loss, that exception is chained as ``__cause__``.
    """
