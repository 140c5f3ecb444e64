"""pitstop inside the trainers people use: Lightning, the Hugging Face Trainer and Accelerate,
Ray Train, DeepSpeed. Each module imports its tool only when it is imported itself."""
