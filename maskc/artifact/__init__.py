"""What the compiler and the runtime agree on, and the only maskc code both import: the kernel
families (`kernel_families`), the kernel variants and their keys (`variant`), the kernels' argument ABI
(`abi`), the artifact manifest format (`manifest`), the toolchain an object needs (`toolchain`)
and where the runtime gets kernels no artifact holds (`source`). Standard library only, so
`maskc --help` can read the families table."""
