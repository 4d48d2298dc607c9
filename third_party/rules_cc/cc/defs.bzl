# Offline shim: forwards rules_cc's public macros to Bazel 4.2.3's native rules.
def cc_library(**kw):
    native.cc_library(**kw)

def cc_binary(**kw):
    native.cc_binary(**kw)

def cc_test(**kw):
    native.cc_test(**kw)

def cc_import(**kw):
    native.cc_import(**kw)

def cc_toolchain(**kw):
    native.cc_toolchain(**kw)

def cc_toolchain_suite(**kw):
    native.cc_toolchain_suite(**kw)

def objc_library(**kw):
    native.objc_library(**kw)

def objc_import(**kw):
    native.objc_import(**kw)

def cc_proto_library(**kw):
    native.cc_proto_library(**kw)

def fdo_profile(**kw):
    native.fdo_profile(**kw)

def fdo_prefetch_hints(**kw):
    native.fdo_prefetch_hints(**kw)
