"""kv_static_archive: one static library with one object that defines only the listed symbols.

A cc_library's archive holds only its own objects, and linking the transitive archives into an
engine would bring every internal function (kv_*, kvd__* of protobuf-c's generated code) into the
engine's symbol namespace. This rule partially links the whole-archive contents of a library and
its dependencies into one relocatable object (`ld -r`), keeps the listed symbols global and makes
every other defined symbol local (`objcopy --keep-global-symbols`), and archives that object.
Undefined references to system libraries (libprotobuf-c, libxxhash, libmd, libc) stay, for the
engine's link line (kvclient.pc's Libs.private).
"""

def _impl(ctx):
    archives = []
    for li in ctx.attr.lib[CcInfo].linking_context.linker_inputs.to_list():
        for lib in li.libraries:
            a = lib.pic_static_library or lib.static_library
            if a != None:
                archives.append(a)
    if not archives:
        fail("no static libraries under %s" % ctx.attr.lib.label)
    out = ctx.outputs.out
    ctx.actions.run_shell(
        inputs = archives + [ctx.file.symbols],
        outputs = [out],
        progress_message = "Partially linking %s" % out.short_path,
        command = """set -eu
o="{out}.tmp.o"
ld -r -o "$o" --whole-archive {archives} --no-whole-archive
objcopy --keep-global-symbols="{syms}" "$o"
rm -f "{out}"
ar rcsD "{out}" "$o"
rm -f "$o"
""".format(
            out = out.path,
            archives = " ".join([a.path for a in archives]),
            syms = ctx.file.symbols.path,
        ),
    )
    return [DefaultInfo(files = depset([out]))]

kv_static_archive = rule(
    implementation = _impl,
    attrs = {
        "lib": attr.label(providers = [CcInfo], mandatory = True),
        "symbols": attr.label(allow_single_file = True, mandatory = True),
        "out": attr.output(mandatory = True),
    },
)
