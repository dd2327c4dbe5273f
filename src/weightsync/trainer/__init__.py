"""The trainer side: the engine base every transport's trainer engine extends, and the sources it reads."""
