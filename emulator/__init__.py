"""emulator package."""
