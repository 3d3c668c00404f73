"""maskc inside other libraries. Each integration is its own module, imported explicitly
(`import maskc.integrations.transformers`), so `import maskc` never imports them or their
optional dependencies."""
