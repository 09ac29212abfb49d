"""The MDNC documentation's two examples, run as written on shmseq's drop-in names."""
import shmseq


class ProcWorker:
    def __getitem__(self, indx):
        return indx


if __name__ == "__main__":
    dset = shmseq.MPSequence(ProcWorker, dset_size=512, num_workers=1, batch_size=1, shuffle=False)
    with dset.start() as p:
        for i in p:
            print("data:", i)
    with dset.start_test("numpy") as p:
        for i in p:
            print("data:", i)
