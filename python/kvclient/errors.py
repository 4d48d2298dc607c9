"""The KvdError hierarchy: one subclass per kv_err code (common/kv_err.h), each carrying the
code, its name (kvc_err_name) and the sentence libkvclient recorded for the failure (the
daemon's message when kvd refused the request: kvc_last_error).

Codes are looked up by number, so an unknown future code still raises KvdError itself.
"""

from ._lib import lib

__all__ = ["KvdError", "error_class", "raise_for", "KvdDetached"]


class KvdError(Exception):
    """A libkvclient call failed. .code (int kv_err), .name ("ENOSPC"), .message (kvd's or the
    library's sentence), .description (kvc_strerror: the code's fixed description)."""

    code = None  # set on each subclass

    def __init__(self, code, message=None, call=None):
        self.code = int(code)
        self.name = (lib.kvc_err_name(self.code) or b"UNKNOWN").decode()
        self.description = (lib.kvc_strerror(self.code) or b"").decode()
        self.message = message if message else self.description
        self.call = call
        # kvd's sentences start with the code's name already ("EPERM: blocks[0]: ...").
        text = self.message if self.message.startswith(self.name + ":") else "%s: %s" % (
            self.name, self.message)
        if call:
            text = "%s: %s" % (call, text)
        super().__init__(text)


# (code, class name, extra base classes) in kv_err.h's order. Codes 1.. each get a class.
_CODES = [
    (1, "KvdInvalid", (ValueError,)),        # EINVAL
    (2, "KvdNoMemory", (MemoryError,)),      # ENOMEM
    (3, "KvdNoSpace", ()),                   # ENOSPC
    (4, "KvdNotFound", (LookupError,)),      # ENOENT
    (5, "KvdStale", ()),                     # ESTALE
    (6, "KvdPermission", (PermissionError,)),  # EPERM
    (7, "KvdState", ()),                     # ESTATE
    (8, "KvdQuotaExceeded", ()),             # EQUOTA
    (9, "KvdProtocol", ()),                  # EPROTO
    (10, "KvdTooBig", ()),                   # ETOOBIG
    (11, "KvdVersion", ()),                  # EVERSION
    (12, "KvdEpoch", ()),                    # EEPOCH
    (13, "KvdSystem", (OSError,)),           # ESYS
    (14, "KvdClosed", (ConnectionError,)),   # ECLOSED
    (15, "KvdBusy", ()),                     # EBUSY
    (16, "KvdExists", ()),                   # EEXIST
    (17, "KvdDraining", ()),                 # EDRAINING
    (18, "KvdNotSupported", ()),             # ENOTSUP
    (19, "KvdAuth", (PermissionError,)),     # EAUTH
    (20, "KvdNoGpu", ()),                    # ENOGPU
    (21, "KvdTimeout", (TimeoutError,)),     # ETIMEDOUT
    (22, "KvdInternal", ()),                 # EINTERNAL
    (23, "KvdCorrupt", ()),                  # ECORRUPT
]


def _init(self, code=None, message=None, call=None):
    KvdError.__init__(self, type(self).code if code is None else code, message, call)


def _make(code, name, bases):
    # OSError-derived classes need __init__ to bypass OSError's errno handling; KvdError first
    # in the MRO does that, and __str__ comes from Exception through KvdError.
    cls = type(name, (KvdError,) + bases, {"code": code, "__init__": _init,
                                           "__str__": lambda self: Exception.__str__(self),
                                           "__module__": __name__})
    return cls


_BY_CODE = {}
for _code, _name, _bases in _CODES:
    _cls = _make(_code, _name, _bases)
    globals()[_name] = _cls
    __all__.append(_name)
    _BY_CODE[_code] = _cls


class KvdDetached(KvdState):  # noqa: F821 (made above)
    """The Python object was detached or closed: its pool (or connection) may not be used any
    more. A KvdState (ESTATE), as the C library answers for the shell of a detached pool."""

    def __init__(self, what="pool"):
        KvdError.__init__(self, 7, "the %s was detached or closed" % what)


__all__.append("KvdDetached")


def error_class(code):
    """The KvdError subclass of a kv_err code (KvdError for a code not in the map)."""
    return _BY_CODE.get(int(code), KvdError)


def raise_for(code, call=None, message=None):
    """Raises the error of code with the calling thread's last libkvclient failure."""
    if message is None:
        message = (lib.kvc_last_error(None) or b"").decode(errors="replace")
    cls = _BY_CODE.get(code)
    if cls is None:
        raise KvdError(code, message, call)
    raise cls(code, message, call)
