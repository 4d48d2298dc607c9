# Offline shim: forwards rules_java's public macros to Bazel 4.2.3's native rules.
def java_binary(**kw):
    native.java_binary(**kw)

def java_import(**kw):
    native.java_import(**kw)

def java_library(**kw):
    native.java_library(**kw)

def java_lite_proto_library(**kw):
    native.java_lite_proto_library(**kw)

def java_proto_library(**kw):
    native.java_proto_library(**kw)

def java_test(**kw):
    native.java_test(**kw)

def java_package_configuration(**kw):
    native.java_package_configuration(**kw)

def java_plugin(**kw):
    native.java_plugin(**kw)

def java_runtime(**kw):
    native.java_runtime(**kw)

def java_toolchain(**kw):
    native.java_toolchain(**kw)
