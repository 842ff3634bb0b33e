"""Start the Monarch kernel: ``python -m monarch_kernel.kernel -f CONNECTION_FILE``.

This is the command in the kernelspec's ``argv``; Jupyter runs it.
"""

if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    from monarch_kernel.kernel.kernel import MonarchKernel

    # outstream_class: ipykernel's OutStream without its idle flushes (see .iostream)
    IPKernelApp.launch_instance(kernel_class=MonarchKernel,
                                outstream_class="monarch_kernel.kernel.iostream.OutStream")
